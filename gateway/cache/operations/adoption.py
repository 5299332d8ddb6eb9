"""Restart adoption: indexing the blocks a store kept from the last run, so they serve again.

A process that restarts finds its disk tier full of blocks the new index knows nothing about.
They are worth keeping -- a restart should not cost every prefix its first request -- but only
as whole chains: a block is usable only with all its ancestors, so one whose parent did not
survive is deleted, as is anything the tier's policy cannot admit. This happens once, before
the cache serves, and is separate from the request path so that neither has to think about the
other's order of events.

A block keeps the expiry its authenticated header carries (``BlockMeta.expiry``): one that
expired while the process was down is deleted (counted as a "ttl" eviction of the tier) and so
are its descendants; the others expire when their header says, with their own sliding TTL from
then on. (Hits after the block was written moved its expiry later without rewriting the file,
so after a restart a block can expire early, never late.)

Pins are kept over a restart: the blocks the pin log names (``gateway.cache.pins``, saved
beside the disk tier's blocks whenever a pin or unpin changed them) are pinned again as they
are adopted, whatever their header's expiry says -- a pinned block never expires, and a block
pinned after it was written carries the expiry it had then. Their TTL runs again from an unpin.
The log names keys only: what a pinned block serves is decided by its own MAC, as for any
other. A pinned block the restart does not adopt (its file lost to a fault, or never written
before a kill -9) is no longer pinned: the log is saved again without it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from gateway.cache.placement import TierPlacement
from gateway.cache.prefix_cache import PrefixCache
from gateway.cache.radix_index import BlockRecord, BlockSpec
from gateway.core.fingerprint import Namespace, Scope
from policies.base import BlockKey
from tiers.base import BlockMeta


def adopt(
    cache: PrefixCache,
    tier: str,
    found: Sequence[tuple[BlockMeta, int]],
    *,
    pinned: Collection[BlockKey] = frozenset(),
) -> int:
    """Index the blocks a store found on restart (e.g. the disk tier's files) in ``tier``.

    Blocks are linked parents first; a block whose parent chain is incomplete is useless (only
    usable with all its ancestors) and is deleted from the store, as is anything the tier's
    policy cannot admit, and anything that has expired (see the module docstring).

    Args:
        cache: the cache (its deletions are carried out after its lock).
        tier: the tier whose store found the blocks.
        found: each block's identity (with the expiry its header carries) and its payload
            size (what the policy charges).
        pinned: the keys the pin log names (``PinLog.load``): those found are pinned again.

    Returns:
        How many blocks were adopted.

    Raises:
        ValueError: ``tier`` is not a tier of the cache.
    """
    placement = cache.placement
    placement.slot(tier)  # an unknown tier fails before anything changes
    sizes = {meta.key: size for meta, size in found}
    metas = [meta for meta, _ in found]
    children: dict[bytes, list[BlockMeta]] = {}
    for meta in metas:
        children.setdefault(meta.parent_key, []).append(meta)
    adopted = 0
    with placement.locked():
        placed: set[BlockKey] = set()
        roots = [m for m in metas if m.parent_key == bytes(len(m.key))]
        stack: list[tuple[BlockMeta, BlockRecord | None]] = [(m, None) for m in roots]
        now = placement.now()
        while stack:
            meta, parent = stack.pop()
            expiry = meta.expiry
            ttl_s = None if expiry is None else expiry.ttl_s
            last_use = now
            is_pinned = meta.key in pinned
            if not is_pinned and expiry is not None and expiry.expires_at is not None:
                due = placement.to_monotonic(expiry.expires_at)
                if due <= now:  # expired while the process was down
                    placement.counters(tier).count_eviction("ttl")
                    continue
                if ttl_s is not None:
                    last_use = due - ttl_s  # so that it expires when its header says
            spec = BlockSpec(key=meta.key, tokens=meta.tokens, num_bytes=sizes[meta.key])
            records = placement.index.insert(_namespace_for(placement, meta, tier), parent, [spec],
                                             now=last_use, ttl_s=ttl_s)
            if not records:
                continue
            record = records[0]
            if not placement.holds(record, tier) and not placement.place(record, tier):
                continue
            placed.add(meta.key)
            adopted += 1
            if is_pinned:
                placement.pins.set(record, True)
            stack.extend((child, record) for child in children.get(meta.key, []))
        _delete_strays(placement, tier, [m for m in metas if m.key not in placed])
        if not set(pinned) <= placed:
            placement.pins.mark_changed()  # the log names blocks no longer here: forget them
        moves = placement.take_moves()
    cache.run_moves(moves)
    cache.keep_pins()
    return adopted


def _delete_strays(placement: TierPlacement, tier: str, strays: Sequence[BlockMeta]) -> None:
    """Forget what was not adopted, and delete its bytes unless the tier holds it anyway."""
    for meta in strays:
        stray = placement.index.get(meta.key)
        if stray is not None:
            placement.drop_unheld([stray])
        if stray is None or not placement.holds(stray, tier):
            placement.queue_delete(meta.key, tier)


def _namespace_for(placement: TierPlacement, meta: BlockMeta, tier: str) -> Namespace:
    """The namespace a stored block belongs to: one the index knows, or one rebuilt from the
    block's header (its digest and owner are all the index needs) and the tier it was found in
    (a lossy tier's blocks are of a lossy namespace: its codec reads nothing else)."""
    for namespace in placement.index.namespaces():
        if namespace.digest == meta.namespace_digest:
            return namespace
    scope = Scope.shared() if meta.owner == "shared" else Scope.of_tenant(meta.owner)
    return Namespace(digest=meta.namespace_digest, scope=scope,
                     quantization=placement.slot(tier).quantization)
