"""The cache's seams: ``TierEvents``, told whenever a tier gains or loses a copy; ``PinLog``,
where pins outlive the process (at the end).

Routers that pick a replica by where a prefix is cached (llm-d's endpoint picker, Dynamo's KV
router, SGLang's model gateway) learn that from a stream of "block stored" / "block removed"
events, as vLLM publishes them (``gateway.service.kv_events``). The placement
(``gateway.cache.placement``) is the only code that changes what a tier holds, so it alone
calls this seam -- the deciding side, under the cache's lock, in the order the changes happen.

An observer is told, never asked: it returns nothing, must not block (the request path holds
the cache's lock while it is called) and must never call back into the cache. What it needs of
a block arrives in the call (``BlockMeta``: key, parent key, token bytes, namespace digest,
owner), so it keeps no reference to the cache's records.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from policies.base import BlockKey
from tiers.base import BlockMeta


class TierEvents(Protocol):
    """What an observer of the cache's tiers is told (``TierPlacement(events=...)``).

    Every tier is reported, by the name the cache gives it ("device", "host", "disk"); an
    observer that cares for some tiers only filters by name itself.
    """

    def stored(self, meta: BlockMeta, tier: str) -> None:
        """``tier`` now holds a copy of the block ``meta`` names (its parent is held wherever
        it is: a block is only usable with all its ancestors)."""
        ...

    def removed(self, key: BlockKey, tier: str) -> None:
        """``tier`` no longer holds a copy of ``key`` (evicted, demoted, expired, forgotten
        after a failed load or write)."""
        ...

    def cleared(self) -> None:
        """No tier holds any block any more (an operator evicted everything); the removals
        were each reported before this."""
        ...


class PinLog(Protocol):
    """Where the pinned blocks' keys outlive the process (``tiers.pin_manifest.PinManifest``,
    beside the disk tier's blocks); ``gateway.cache.pins`` says when it is written."""

    def load(self) -> frozenset[BlockKey]:
        """The keys saved last (none if nothing was saved, or what was saved cannot be
        trusted)."""
        ...

    def save(self, keys: Collection[BlockKey]) -> bool:
        """Replace what is saved with ``keys``, durably; False if that failed (logged)."""
        ...
