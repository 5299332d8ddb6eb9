"""TierPolicy: admission, eviction in passes, refusals and their messages, expiry sweeps."""

from __future__ import annotations

import pytest

from policies import (
    BlockKey,
    ClockPolicy,
    EvictionResult,
    InsertRefused,
    LRUPolicy,
    QuotaPolicy,
    TierPolicy,
    TTLPolicy,
)
from tests.policies.fakes import FakeClock, entry, key


class Owner:
    """A tier's view of its blocks as a tree: a block may go only when it is not pinned and has
    no children. ``remove`` records the order of removals and checks that rule."""

    def __init__(self) -> None:
        self.parent_of: dict[BlockKey, BlockKey | None] = {}
        self.pinned: set[BlockKey] = set()
        self.removed: list[BlockKey] = []

    def add(self, k: BlockKey, parent: BlockKey | None = None) -> None:
        self.parent_of[k] = parent

    def can_evict(self, k: BlockKey) -> bool:
        has_child = any(p == k for p in self.parent_of.values())
        return k not in self.pinned and not has_child

    def remove(self, k: BlockKey) -> None:
        assert self.can_evict(k), f"{k.hex()} removed while not evictable"
        del self.parent_of[k]
        self.removed.append(k)


def make_tier(
    budget_bytes: int = 10,
    *,
    clock: FakeClock | None = None,
    quotas: dict[str, int] | None = None,
    order: LRUPolicy | ClockPolicy | None = None,
) -> TierPolicy:
    return TierPolicy(
        budget_bytes=budget_bytes,
        order=order or LRUPolicy(),
        ttl=None if clock is None else TTLPolicy(clock=clock),
        quota=None if quotas is None else QuotaPolicy(quotas),
    )


def admit(
    tier: TierPolicy,
    owner: Owner,
    n: int,
    *,
    tenant: str = "t",
    num_bytes: int = 1,
    ttl_s: float | None = None,
    parent: int | None = None,
) -> EvictionResult:
    result = tier.admit(
        entry(n, tenant=tenant, num_bytes=num_bytes, ttl_s=ttl_s),
        can_evict=owner.can_evict,
        remove=owner.remove,
    )
    owner.add(key(n), None if parent is None else key(parent))
    return result


def keys(*ns: int) -> tuple[BlockKey, ...]:
    return tuple(key(n) for n in ns)


# -- admission ---------------------------------------------------------------------------------


def test_an_entry_that_fits_is_admitted_without_evicting() -> None:
    tier, owner = make_tier(10), Owner()
    result = admit(tier, owner, 0, num_bytes=4)
    assert result == EvictionResult(victims=(), freed_bytes=0, requested_bytes=0)
    assert key(0) in tier
    assert tier.entry(key(0)) == entry(0, num_bytes=4)
    assert (tier.used_bytes, tier.num_entries, tier.used_bytes_of("t")) == (4, 1, 4)


def test_admission_evicts_least_recently_used_blocks_until_the_entry_fits() -> None:
    tier, owner = make_tier(10), Owner()
    for n in range(5):
        admit(tier, owner, n, num_bytes=2)
    tier.access(key(0))
    result = admit(tier, owner, 9, num_bytes=5)
    assert result == EvictionResult(victims=keys(1, 2, 3), freed_bytes=6, requested_bytes=5)
    assert set(tier.keys()) == set(keys(0, 4, 9))
    assert tier.used_bytes == 9


def test_expired_blocks_go_before_least_recently_used_ones() -> None:
    clock = FakeClock()
    tier, owner = make_tier(6, clock=clock), Owner()
    admit(tier, owner, 0, num_bytes=2)
    admit(tier, owner, 1, num_bytes=2, ttl_s=5)
    admit(tier, owner, 2, num_bytes=2, ttl_s=3)
    clock.advance(5)
    result = admit(tier, owner, 3, num_bytes=4)
    assert result.victims == keys(2, 1)  # earliest expiry first, and the LRU block 0 stays


def test_a_block_both_expired_and_least_recent_is_removed_once() -> None:
    clock = FakeClock()
    tier, owner = make_tier(4, clock=clock), Owner()
    admit(tier, owner, 0, num_bytes=2, ttl_s=1)
    admit(tier, owner, 1, num_bytes=2)
    clock.advance(1)
    result = admit(tier, owner, 2, num_bytes=4)
    assert result.victims == keys(0, 1)
    assert owner.removed == list(keys(0, 1))


def test_a_block_both_expired_and_ranked_counts_once_toward_a_pass() -> None:
    """Counted twice, block 0 would end the first pass early, and block 2 (0's parent, ranked
    first) would go in a second pass instead of block 1."""
    clock = FakeClock()
    tier, owner = make_tier(6, clock=clock), Owner()
    admit(tier, owner, 2, num_bytes=2)
    admit(tier, owner, 0, num_bytes=2, ttl_s=1, parent=2)
    admit(tier, owner, 1, num_bytes=2)
    clock.advance(1)
    result = admit(tier, owner, 3, num_bytes=4)
    assert result.victims == keys(0, 1)


def test_an_over_quota_tenant_frees_its_own_blocks_only() -> None:
    tier, owner = make_tier(100, quotas={"a": 4}), Owner()
    admit(tier, owner, 0, tenant="b", num_bytes=2)  # least recent overall
    admit(tier, owner, 1, tenant="a", num_bytes=2)
    admit(tier, owner, 2, tenant="a", num_bytes=2)
    result = admit(tier, owner, 3, tenant="a", num_bytes=2)
    assert result == EvictionResult(victims=keys(1), freed_bytes=2, requested_bytes=2)
    assert tier.used_bytes_of("a") == 4
    assert key(0) in tier


def test_quota_then_budget_shortfalls_are_freed_in_turn() -> None:
    tier, owner = make_tier(6, quotas={"a": 4}), Owner()
    admit(tier, owner, 0, tenant="b", num_bytes=3)
    admit(tier, owner, 1, tenant="a", num_bytes=1)
    admit(tier, owner, 2, tenant="a", num_bytes=2)
    # 'a' holds 3 B: 1 B over its quota, freed from its own block 1. The tier then holds 5 B,
    # 1 B over budget, freed from the least recent block of anyone: 'b's block 0.
    result = admit(tier, owner, 3, tenant="a", num_bytes=2)
    assert result == EvictionResult(victims=keys(1, 0), freed_bytes=4, requested_bytes=2)


def test_a_parent_is_evicted_only_after_its_children() -> None:
    tier, owner = make_tier(3), Owner()
    admit(tier, owner, 0)
    admit(tier, owner, 1, parent=0)
    admit(tier, owner, 2, parent=1)
    result = tier.evict(3, can_evict=owner.can_evict, remove=owner.remove)
    assert result == EvictionResult(victims=keys(2, 1, 0), freed_bytes=3, requested_bytes=3)
    assert tier.num_entries == 0


def test_admitting_a_tracked_key_is_a_value_error() -> None:
    tier, owner = make_tier(), Owner()
    admit(tier, owner, 0)
    with pytest.raises(ValueError, match="already in this tier"):
        admit(tier, owner, 0)


def test_a_negative_size_is_a_value_error() -> None:
    tier, owner = make_tier(), Owner()
    with pytest.raises(ValueError, match="num_bytes=-1"):
        admit(tier, owner, 0, num_bytes=-1)


# -- refusals ----------------------------------------------------------------------------------


def test_an_entry_larger_than_the_budget_is_refused_before_evicting() -> None:
    tier, owner = make_tier(10), Owner()
    admit(tier, owner, 0, num_bytes=10)
    with pytest.raises(InsertRefused) as refused:
        admit(tier, owner, 1, num_bytes=11)
    assert str(refused.value) == (
        f"block {key(1).hex()} (11 B) is larger than the tier's whole budget (10 B); "
        "it can never be admitted"
    )
    assert owner.removed == []
    assert key(1) not in tier


def test_an_entry_larger_than_its_quota_is_refused_before_evicting() -> None:
    tier, owner = make_tier(100, quotas={"a": 5}), Owner()
    admit(tier, owner, 0, tenant="a", num_bytes=5)
    with pytest.raises(InsertRefused) as refused:
        admit(tier, owner, 1, tenant="a", num_bytes=6)
    assert str(refused.value) == (
        f"block {key(1).hex()} (6 B) is larger than the whole quota of tenant 'a' (5 B); "
        "it can never be admitted"
    )
    assert owner.removed == []
    assert key(1) not in tier


def test_an_entry_larger_than_the_budget_is_refused_before_a_quota_eviction() -> None:
    tier, owner = make_tier(5, quotas={"a": 8}), Owner()
    admit(tier, owner, 0, tenant="a", num_bytes=5)
    with pytest.raises(InsertRefused, match="larger than the tier's whole budget"):
        admit(tier, owner, 1, tenant="a", num_bytes=6)  # fits the quota, not the budget
    assert owner.removed == []


def test_a_budget_held_by_pinned_blocks_refuses_and_says_how_much_was_missing() -> None:
    tier, owner = make_tier(10), Owner()
    admit(tier, owner, 0, num_bytes=4)
    admit(tier, owner, 1, num_bytes=1)
    admit(tier, owner, 2, num_bytes=4)
    owner.pinned |= {key(0), key(2)}
    with pytest.raises(InsertRefused) as refused:
        admit(tier, owner, 3, num_bytes=4)
    assert str(refused.value) == (
        f"cannot admit block {key(3).hex()} (4 B, tenant 't'): 3 B had to be freed to stay "
        "within the tier's budget (10 B), but only 1 B could be evicted; the other 2 B are held "
        "by blocks that cannot be evicted (pinned, in use, or ancestors of such blocks)"
    )
    assert owner.removed == [key(1)]  # what was evicted stays evicted
    assert key(1) not in tier
    assert key(3) not in tier
    assert tier.used_bytes == 8


def test_a_quota_held_by_pinned_blocks_refuses_without_touching_other_tenants() -> None:
    tier, owner = make_tier(100, quotas={"a": 4}), Owner()
    admit(tier, owner, 0, tenant="b", num_bytes=3)
    admit(tier, owner, 1, tenant="a", num_bytes=4)
    owner.pinned.add(key(1))
    with pytest.raises(InsertRefused) as refused:
        admit(tier, owner, 2, tenant="a", num_bytes=2)
    assert str(refused.value) == (
        f"cannot admit block {key(2).hex()} (2 B, tenant 'a'): 2 B had to be freed to stay "
        "within the quota of tenant 'a' (4 B), from its own blocks, but only 0 B could be "
        "evicted; the other 2 B are held by blocks that cannot be evicted (pinned, in use, or "
        "ancestors of such blocks)"
    )
    assert owner.removed == []
    assert key(2) not in tier


def test_an_ancestor_of_a_pinned_block_cannot_make_room() -> None:
    tier, owner = make_tier(3), Owner()
    admit(tier, owner, 0)
    admit(tier, owner, 1, parent=0)
    admit(tier, owner, 2, parent=1)
    owner.pinned.add(key(2))
    with pytest.raises(InsertRefused, match="but only 0 B could be evicted"):
        admit(tier, owner, 3)
    assert owner.removed == []


# -- evict -------------------------------------------------------------------------------------


def test_evict_frees_at_least_what_was_asked() -> None:
    tier, owner = make_tier(100), Owner()
    for n in range(4):
        admit(tier, owner, n, num_bytes=3)
    result = tier.evict(4, can_evict=owner.can_evict, remove=owner.remove)
    assert result == EvictionResult(victims=keys(0, 1), freed_bytes=6, requested_bytes=4)
    assert result.is_satisfied


def test_evict_reports_when_it_could_not_free_enough() -> None:
    tier, owner = make_tier(100), Owner()
    admit(tier, owner, 0, num_bytes=3)
    admit(tier, owner, 1, num_bytes=3)
    owner.pinned.add(key(0))
    result = tier.evict(5, can_evict=owner.can_evict, remove=owner.remove)
    assert result == EvictionResult(victims=keys(1), freed_bytes=3, requested_bytes=5)
    assert not result.is_satisfied


def test_evict_for_a_tenant_takes_only_that_tenants_blocks() -> None:
    tier, owner = make_tier(100), Owner()
    admit(tier, owner, 0, tenant="a")
    admit(tier, owner, 1, tenant="b")
    admit(tier, owner, 2, tenant="b")
    result = tier.evict(5, tenant="b", can_evict=owner.can_evict, remove=owner.remove)
    assert result.victims == keys(1, 2)
    assert key(0) in tier


def test_evict_zero_bytes_removes_nothing() -> None:
    tier, owner = make_tier(), Owner()
    admit(tier, owner, 0)
    assert tier.evict(0, can_evict=owner.can_evict, remove=owner.remove).victims == ()


def test_evicting_a_negative_amount_is_a_value_error() -> None:
    tier, owner = make_tier(), Owner()
    with pytest.raises(ValueError, match="num_bytes must be >= 0"):
        tier.evict(-1, can_evict=owner.can_evict, remove=owner.remove)


def test_evict_follows_the_clock_order_when_clock_ranks() -> None:
    tier, owner = make_tier(100, order=ClockPolicy()), Owner()
    for n in range(3):
        admit(tier, owner, n)
    tier.access(key(0))
    result = tier.evict(2, can_evict=owner.can_evict, remove=owner.remove)
    assert result.victims == keys(1, 2)


def test_a_remove_callback_that_discards_the_key_itself_is_fine() -> None:
    tier, owner = make_tier(100), Owner()
    admit(tier, owner, 0, num_bytes=2)

    def remove(k: BlockKey) -> None:
        owner.remove(k)
        tier.discard(k)

    result = tier.evict(2, can_evict=owner.can_evict, remove=remove)
    assert result == EvictionResult(victims=keys(0), freed_bytes=2, requested_bytes=2)
    assert tier.used_bytes == 0


# -- expiry ------------------------------------------------------------------------------------


def test_sweep_removes_every_expired_evictable_block() -> None:
    clock = FakeClock()
    tier, owner = make_tier(100, clock=clock), Owner()
    admit(tier, owner, 0, num_bytes=1, ttl_s=2)
    admit(tier, owner, 1, num_bytes=2, ttl_s=1, parent=0)
    admit(tier, owner, 2, num_bytes=4, ttl_s=1)
    admit(tier, owner, 3, num_bytes=8, ttl_s=1)
    admit(tier, owner, 4, num_bytes=16)
    owner.pinned.add(key(3))
    clock.advance(2)
    result = tier.sweep_expired(can_evict=owner.can_evict, remove=owner.remove)
    # 0 expired but is 1's parent: it goes in the second pass, once 1 is gone.
    assert result == EvictionResult(victims=keys(1, 2, 0), freed_bytes=7, requested_bytes=15)
    assert not result.is_satisfied  # pinned block 3 is still there
    assert set(tier.keys()) == set(keys(3, 4))


def test_sweep_without_ttl_removes_nothing() -> None:
    tier, owner = make_tier(), Owner()
    admit(tier, owner, 0, ttl_s=0)
    result = tier.sweep_expired(can_evict=owner.can_evict, remove=owner.remove)
    assert result == EvictionResult(victims=(), freed_bytes=0, requested_bytes=0)
    assert not tier.is_expired(key(0))


def test_an_access_keeps_a_block_from_expiring() -> None:
    clock = FakeClock()
    tier, owner = make_tier(clock=clock), Owner()
    admit(tier, owner, 0, ttl_s=10)
    clock.advance(9)
    tier.access(key(0))
    clock.advance(9)
    assert not tier.is_expired(key(0))
    clock.advance(1)
    assert tier.is_expired(key(0))


# -- bookkeeping -------------------------------------------------------------------------------


def test_discard_forgets_a_block_everywhere() -> None:
    clock = FakeClock()
    tier, owner = make_tier(10, clock=clock, quotas={"a": 5}), Owner()
    admit(tier, owner, 0, tenant="a", num_bytes=5, ttl_s=0)
    tier.discard(key(0))
    assert (tier.used_bytes, tier.used_bytes_of("a"), tier.num_entries) == (0, 0, 0)
    assert tier.entry(key(0)) is None
    # Everything is free again, under the quota and the budget, and nothing is offered.
    assert admit(tier, owner, 1, tenant="a", num_bytes=5).victims == ()


def test_discarding_an_untracked_key_does_nothing() -> None:
    tier = make_tier()
    tier.discard(key(0))
    assert tier.num_entries == 0


def test_accessing_or_asking_about_an_untracked_key_is_a_key_error() -> None:
    tier = make_tier(clock=FakeClock())
    with pytest.raises(KeyError):
        tier.access(key(0))
    with pytest.raises(KeyError):
        tier.is_expired(key(0))


def test_eviction_result_is_satisfied_when_freed_reaches_requested() -> None:
    assert EvictionResult(victims=(), freed_bytes=3, requested_bytes=3).is_satisfied
    assert not EvictionResult(victims=(), freed_bytes=2, requested_bytes=3).is_satisfied
