"""An operator's eviction in the shared Redis tier: removing the remote copies it selects.

What one replica evicts must not come back from Redis, or another replica (or this one, on its
next miss) would serve the prefix again. ``gateway.cache.operations.admin`` resolves what an
eviction selects -- the prompts its prefix text renders to, the namespaces of its tenant, the chain
of its key -- and this module turns that into the remote store's removals (by chain, by namespace,
by key, by age), through the cache's ``TierTransfers``. It keeps nothing and holds the cache's lock
only to read which blocks carry a tag. """

from __future__ import annotations

from collections.abc import Sequence

from gateway.cache.lossy_copies import lossy_copies
from gateway.cache.operations.invalidation import EvictionEvent
from gateway.cache.operations.tags import tagged_blocks
from gateway.cache.prefix_cache import PrefixCache
from gateway.core.fingerprint import Namespace
from gateway.core.tokens import TokenIds
from policies.base import BlockKey


def evict_remote(
    cache: PrefixCache,
    event: EvictionEvent,
    *,
    selections: Sequence[tuple[Namespace, TokenIds] | None],
    scope_namespaces: Sequence[Namespace] | None,
    chain_keys: Sequence[BlockKey] | None,
) -> None:
    """Remove from the remote store what ``event`` selects (nothing without a remote store).

    Args:
        cache: the cache whose remote store is cleaned.
        event: the eviction (its tier is None or the remote one).
        selections: the prompts its prefix text names (``[None]`` when it names none).
        scope_namespaces: the namespaces of its tenant's scope; None: every namespace of the
            deployment.
        chain_keys: the keys of its key's chain; None: no key was named.
    """
    transfers = cache.transfers
    if transfers is None or not transfers.has_remote:
        return
    min_idle_s = event.older_than_s
    if event.prefix_text is not None:
        for under in selections:
            if under is not None:
                transfers.forget_remote(*under, min_idle_s=min_idle_s)
        return
    if event.tag is not None:
        # Redis keeps no tags: remove, by key, the copies of the blocks tagged here.
        placement = cache.placement
        with placement.locked():
            tagged = tagged_blocks(placement.index, event.tag, owner=event.tenant)
            blocks = [(r.namespace.digest, r.key) for r in tagged]
            # And the lossy copies written through for them (docs/design.md, "Lossy tiers").
            blocks += [(ns.digest, key) for ns, key in lossy_copies(cache, tagged)]
        for block_digest, block_key in blocks:
            transfers.remove_remote_where(namespace_digest=block_digest, key=block_key,
                                          min_idle_s=min_idle_s)
        return
    digests: list[bytes | None] = (
        [None] if scope_namespaces is None else [ns.digest for ns in scope_namespaces])
    keys: list[BlockKey | None] = [None] if chain_keys is None else list(chain_keys)
    for digest in digests:
        for key in keys:
            transfers.remove_remote_where(namespace_digest=digest, key=key,
                                          min_idle_s=min_idle_s)
