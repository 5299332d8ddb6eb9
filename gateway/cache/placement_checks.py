"""The placement's invariants, checked whole (tests and property tests call it through
``PrefixCache.check_invariants``; nothing on the request path does).

What it asserts is docs/design.md's "The radix index" and "Blocks": the index is well formed;
each tier's policy tracks exactly the blocks the index says the tier holds; a block held by no
tier lives only while it has children or references; no block outlives its parent; and no byte
move decided under the lock was left neither carried out nor posted.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.cache.radix_index import RadixIndex
from gateway.cache.tier_slot import TierSlot
from gateway.core.errors import IndexInvariantError


def check_placement(index: RadixIndex, tiers: Sequence[tuple[TierSlot, int]], *,
                    num_moving: int) -> None:
    """Assert the invariants over ``index`` and ``tiers`` (each slot with its bit in a
    record's ``tier_mask``), with ``num_moving`` moves not settled once posted ones are.

    Raises:
        IndexInvariantError: the first disagreement found.
    """
    index.check_invariants()
    if num_moving:
        raise IndexInvariantError(f"{num_moving} byte moves decided and never carried out")
    for slot, bit in tiers:
        held = {r.key for r in index.records() if r.tier_mask & bit}
        tracked = set(slot.policy.keys())
        if held != tracked:
            raise IndexInvariantError(
                f"tier {slot.name}: {len(held)} blocks held, {len(tracked)} tracked")
    for record in index.records():
        if record.tier_mask == 0 and not (index.has_children(record) or record.refcount):
            raise IndexInvariantError("a block held by no tier outlived its use")
        parent = record.parent
        if parent is not None and parent.key not in index:
            raise IndexInvariantError("a block outlived its parent")
