"""The placement primitives that transfers, admin and adoption build on.

The prefix cache's tests (and its state machine) exercise these through the request path; here
each rule is stated once against the placement itself.
"""

from __future__ import annotations

import pytest

from gateway.cache.placement import TierPlacement
from gateway.cache.radix_index import BlockRecord, BlockSpec
from gateway.cache.tier_slot import TierSlot
from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from policies.base import BlockKey
from policies.registry import TierPolicyConfig, build_tier_policy
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.memory import DeviceStore

NS = derive_namespace(NamespaceSpec(deployment_secret=b"k" * 32, model_fingerprint="tiny",
                                    kv_dtype="float32", device_kind="cpu",
                                    scope=Scope.of_tenant("a")))


def make_placement(budget_blocks: int) -> TierPlacement:
    slot = TierSlot(name="device", policy=build_tier_policy(
        TierPolicyConfig(budget_bytes=budget_blocks * 10)))
    return TierPlacement(tiers=[slot], block_tokens=2)


def device_host(device_blocks: int, host_blocks: int) -> tuple[TierPlacement, TierHierarchy]:
    """Two tiers over real stores, which the placement must never touch itself."""
    slots = [TierSlot(name=name, policy=build_tier_policy(TierPolicyConfig(budget_bytes=n * 10)))
             for name, n in (("device", device_blocks), ("host", host_blocks))]
    hierarchy = TierHierarchy([TierLevel(name=name, store=DeviceStore(device="cpu", name=name))
                               for name in ("device", "host")])
    return TierPlacement(tiers=slots, block_tokens=2, hierarchy=hierarchy), hierarchy


def chain(placement: TierPlacement, *names: bytes,
          parent: BlockRecord | None = None) -> list[BlockRecord]:
    specs = [BlockSpec(key=BlockKey(n * 16), tokens=n * 8, num_bytes=10) for n in names]
    with placement.locked():
        return placement.index.insert(NS, parent, specs, now=placement.now(), ttl_s=None)


def test_place_makes_room_by_eviction_but_never_evicts_the_block_placed() -> None:
    placement = make_placement(budget_blocks=1)
    (first,) = chain(placement, b"a")
    (second,) = chain(placement, b"b")
    with placement.locked():
        assert placement.place(first, "device")
        assert placement.place(second, "device")  # evicts the first, not itself
        assert placement.holds(second, "device")
        assert first.key not in placement.index  # held by no tier and no one: it left
    placement.check_invariants()


def test_a_full_tier_of_pinned_blocks_refuses_and_holds_nothing() -> None:
    placement = make_placement(budget_blocks=1)
    (pinned,) = chain(placement, b"a")
    (refused,) = chain(placement, b"b")
    with placement.locked():
        assert placement.place(pinned, "device")
        pinned.is_pinned = True
        assert not placement.place(refused, "device")
        assert placement.tiers_in([refused]) == ()
        assert refused.refcount == 0


def test_a_copy_leaves_only_after_its_children() -> None:
    placement = make_placement(budget_blocks=4)
    parent, child = chain(placement, b"a", b"b")
    with placement.locked():
        assert placement.place(parent, "device") and placement.place(child, "device")
        assert not placement.may_leave(parent, "device")
        assert placement.may_leave(child, "device")


def test_releasing_a_reference_nobody_holds_is_a_bug() -> None:
    placement = make_placement(budget_blocks=1)
    (record,) = chain(placement, b"a")
    with placement.locked(), pytest.raises(IndexInvariantError, match="below zero"):
        placement.unhold([record])


def test_an_eviction_decides_its_demotion_and_queues_the_byte_moves_in_order() -> None:
    placement, hierarchy = device_host(device_blocks=1, host_blocks=4)
    (first,) = chain(placement, b"a")
    (second,) = chain(placement, b"b")
    with placement.locked():
        assert placement.place(first, "device")
        assert placement.place(second, "device")  # evicts the first: down to host
        moves = placement.take_moves()
        # Copy into host, then delete from device: the steps, not the bytes.
        assert [(m.key, m.source, m.tier, m.is_delete) for m in moves] == [
            (first.key, "device", "host", False), (first.key, None, "device", True)]
        assert placement.tiers_in([first]) == ("host",)
        assert placement.plan_reads([first]) == ()  # its bytes have not landed in host
        assert first.refcount == 1  # the copy holds it until settled
        assert not placement.place(first, "device")  # nor is it placed back meanwhile
        for move in moves:
            placement.settle(move, is_done=True)
        assert placement.plan_reads([first])[0].tiers == ("host",) and first.refcount == 0
        assert placement.counters("device").demotions == 1
    assert [s.num_blocks for s in hierarchy.stats()] == [0, 0]  # no byte was moved here
    placement.check_invariants()


def first_demoted_by_a_second() -> tuple[TierPlacement, BlockRecord]:
    """A one-block device tier given a second block: the first's demotion to host is queued
    (its copy, then its deletion), not taken."""
    placement, _ = device_host(device_blocks=1, host_blocks=4)
    (first,) = chain(placement, b"a")
    (second,) = chain(placement, b"b")
    with placement.locked():
        assert placement.place(first, "device") and placement.place(second, "device")
    return placement, first


def test_moves_posted_by_the_transfers_are_settled_when_the_lock_is_next_taken() -> None:
    placement, first = first_demoted_by_a_second()
    with placement.locked():
        moves = placement.take_moves()
    placement.move_outcomes.post(moves, [True] * len(moves))  # what TierTransfers.run does
    assert first.refcount == 1  # posted, not settled yet
    with placement.locked():
        assert first.refcount == 0 and placement.counters("device").demotions == 1
        assert placement.plan_reads([first])[0].tiers == ("host",)
    placement.check_invariants()


def test_a_demotion_whose_source_is_gone_forgets_the_copy_it_made_room_for() -> None:
    placement, first = first_demoted_by_a_second()
    with placement.locked():
        for move in placement.take_moves():
            placement.settle(move, is_done=False)
        assert first.key not in placement.index
        assert placement.counters("device").demotions == 0
    placement.check_invariants()


def test_a_move_never_carried_out_breaks_the_invariants() -> None:
    placement, _ = first_demoted_by_a_second()
    with pytest.raises(IndexInvariantError, match="never carried out"):
        placement.check_invariants()
