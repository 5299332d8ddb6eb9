"""What the worker's tiers gained and lost since the last step, for the scheduler's view.

Why from the tiers' own events: blocks leave the worker's cache in ways no order of the
scheduler causes -- an LRU eviction, an expiry, an operator's eviction arriving on the Redis
stream -- and the scheduler, which cannot see the cache (``known_keys``), would go on
promising them: each stale promise costs vLLM a failed load and a recompute. So the cache's
``TierEvents`` (``gateway.cache.base``) are collected here, from whichever thread the tiers
report on, and each step's report says which keys arrived and which are in no tier any more.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from policies.base import BlockKey
from tiers.base import BlockMeta


class KeyChanges:
    """A ``TierEvents`` observer that keeps the keys stored and removed since the last drain."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: set[BlockKey] = set()
        self._removed: set[BlockKey] = set()

    def stored(self, meta: BlockMeta, tier: str) -> None:
        with self._lock:
            self._stored.add(meta.key)
            self._removed.discard(meta.key)

    def removed(self, key: BlockKey, tier: str) -> None:
        with self._lock:
            self._removed.add(key)

    def cleared(self) -> None:
        return  # every removal was reported first

    def drain(self, tiers_of: Callable[[BlockKey], tuple[str, ...]]
              ) -> tuple[set[BlockKey], set[BlockKey]]:
        """The keys stored since the last drain, and those removed that no tier holds now
        (``tiers_of``: where the cache holds a key)."""
        with self._lock:
            stored, removed = self._stored, self._removed
            self._stored, self._removed = set(), set()
        gone = {key for key in removed if not tiers_of(key)}
        return stored - gone, gone
