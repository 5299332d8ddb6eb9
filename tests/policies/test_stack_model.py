"""TierPolicy against a naive reference, on a tree-shaped owner with pinned blocks.

The owner holds blocks as a forest (a block's parent is an earlier block) and may give a block
up only when it is unpinned, has no children, and is not the parent of the block being
admitted (that one is in use). Random admissions, reads, pins, evictions, sweeps and clock moves
then check the promises ``TierPolicy`` makes:

* pinned blocks are never removed, and a parent never while a child is present (the owner's
  ``remove`` asserts it);
* the tier never holds more than its budget, a tenant never more than its quota;
* an over-quota tenant's admission frees its own blocks before anyone else's is touched;
* ``evict`` frees what was asked or says it did not, and then nothing more could have gone;
* a refused admission leaves the entry untracked.

With LRU as the order the reference also predicts every victim, in order: it is the documented
algorithm written over a plain list and a dict of expiry times. With CLOCK the reference
follows the policy's victims and checks the promises only.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from policies import (
    BlockKey,
    InsertRefused,
    PolicyEntry,
    TierPolicyConfig,
    build_tier_policy,
)
from tests.policies.fakes import FakeClock, key

BUDGET = 60
QUOTAS = {"a": 25, "b": 40}  # 'c' has no quota
TENANTS = ("a", "b", "c")
TTLS = (None, 1.0, 3.0)


class Tree:
    """The owner: which blocks exist, their parents, which are pinned, which one is in use."""

    def __init__(self) -> None:
        self.parent_of: dict[BlockKey, BlockKey | None] = {}
        self.num_children: dict[BlockKey, int] = {}
        self.pinned: set[BlockKey] = set()
        self.in_use: BlockKey | None = None
        self.removed: list[BlockKey] = []

    def add(self, k: BlockKey, parent: BlockKey | None) -> None:
        self.parent_of[k] = parent
        self.num_children[k] = 0
        if parent is not None:
            self.num_children[parent] += 1

    def can_evict(self, k: BlockKey) -> bool:
        return k not in self.pinned and self.num_children[k] == 0 and k != self.in_use

    def remove(self, k: BlockKey) -> None:
        assert k not in self.pinned, "a pinned block was removed"
        assert self.num_children[k] == 0, "a parent was removed while a child is present"
        assert k != self.in_use, "the parent of the block being admitted was removed"
        parent = self.parent_of.pop(k)
        del self.num_children[k]
        self.pinned.discard(k)
        if parent is not None:
            self.num_children[parent] -= 1
        self.removed.append(k)


class ReferenceTier:
    """The documented algorithm, naively: a recency list and a dict of expiries."""

    def __init__(self, clock: FakeClock, tree: Tree) -> None:
        self.clock = clock
        self.tree = tree
        self.entries: dict[BlockKey, PolicyEntry] = {}
        self.recency: list[BlockKey] = []  # least recent first
        self.expiry: dict[BlockKey, tuple[float, int]] = {}
        self.seq = itertools.count()

    def used(self, tenant: str | None = None) -> int:
        return sum(e.num_bytes for e in self.entries.values() if tenant in (None, e.tenant))

    def record(self, e: PolicyEntry) -> None:
        self.entries[e.key] = e
        self.recency.append(e.key)
        if e.ttl_s is not None:
            self.expiry[e.key] = (self.clock.now + e.ttl_s, next(self.seq))

    def access(self, k: BlockKey) -> None:
        self.recency.remove(k)
        self.recency.append(k)
        ttl_s = self.entries[k].ttl_s
        if ttl_s is not None:
            self.expiry[k] = (self.clock.now + ttl_s, next(self.seq))

    def forget(self, k: BlockKey) -> None:
        del self.entries[k]
        self.recency.remove(k)
        self.expiry.pop(k, None)

    def expired(self, tenant: str | None = None) -> list[BlockKey]:
        due = sorted(
            (at, seq, k)
            for k, (at, seq) in self.expiry.items()
            if at <= self.clock.now and tenant in (None, self.entries[k].tenant)
        )
        return [k for _, _, k in due]

    def victim_order(self, tenant: str | None) -> list[BlockKey]:
        expired = self.expired(tenant)
        ranked = [k for k in self.recency if tenant in (None, self.entries[k].tenant)]
        return expired + [k for k in ranked if k not in expired]

    def evict(self, num_bytes: int, tenant: str | None) -> tuple[list[BlockKey], int]:
        victims: list[BlockKey] = []
        freed = 0
        while freed < num_bytes:
            batch: list[BlockKey] = []
            batch_bytes = 0
            for k in self.victim_order(tenant):
                if self.tree.can_evict(k):
                    batch.append(k)
                    batch_bytes += self.entries[k].num_bytes
                    if batch_bytes >= num_bytes - freed:
                        break
            if not batch:
                break
            for k in batch:
                freed += self.entries[k].num_bytes
                self.tree.remove(k)
                self.forget(k)
                victims.append(k)
        return victims, freed

    def admit(self, e: PolicyEntry) -> tuple[bool, list[BlockKey]]:
        quota = QUOTAS.get(e.tenant)
        if e.num_bytes > BUDGET or (quota is not None and e.num_bytes > quota):
            return False, []
        victims: list[BlockKey] = []
        if quota is not None and self.used(e.tenant) + e.num_bytes > quota:
            need = self.used(e.tenant) + e.num_bytes - quota
            taken, freed = self.evict(need, e.tenant)
            victims += taken
            if freed < need:
                return False, victims
        need = self.used() + e.num_bytes - BUDGET
        if need > 0:
            taken, freed = self.evict(need, None)
            victims += taken
            if freed < need:
                return False, victims
        self.record(e)
        return True, victims

    def sweep(self) -> list[BlockKey]:
        victims: list[BlockKey] = []
        while batch := [k for k in self.expired() if self.tree.can_evict(k)]:
            for k in batch:
                self.tree.remove(k)
                self.forget(k)
            victims += batch
        return victims


class TierMachine(RuleBasedStateMachine):
    ORDER = "lru"
    IS_EXACT = True  # whether the reference predicts victims, or follows the policy's

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.tier = build_tier_policy(
            TierPolicyConfig(order=self.ORDER, budget_bytes=BUDGET, quotas=QUOTAS),
            clock=self.clock,
        )
        self.tree = Tree()
        self.reference = ReferenceTier(self.clock, Tree())
        self.next_n = 0

    # -- helpers -------------------------------------------------------------------------------

    def keys(self) -> list[BlockKey]:
        return sorted(self.reference.entries)

    def take_removed(self) -> list[BlockKey]:
        removed, self.tree.removed = self.tree.removed, []
        return removed

    def follow(self, victims: list[BlockKey]) -> list[BlockKey]:
        """Apply the policy's victims to the reference (the CLOCK variant's reference)."""
        for k in victims:
            self.reference.tree.remove(k)
            self.reference.forget(k)
        return victims

    def assert_nothing_more_could_go(self, tenant: str | None) -> None:
        for k, e in self.reference.entries.items():
            if tenant in (None, e.tenant):
                assert not self.tree.can_evict(k), f"{k.hex()} could still have been evicted"

    # -- rules ---------------------------------------------------------------------------------

    @rule(
        data=st.data(),
        tenant=st.sampled_from(TENANTS),
        num_bytes=st.integers(0, 27),
        ttl_s=st.sampled_from(TTLS),
    )
    def admit(self, data: st.DataObject, tenant: str, num_bytes: int, ttl_s: float | None) -> None:
        parent = data.draw(st.none() | st.sampled_from(self.keys())) if self.keys() else None
        e = PolicyEntry(key=key(self.next_n), tenant=tenant, num_bytes=num_bytes, ttl_s=ttl_s)
        self.next_n += 1
        quota = QUOTAS.get(tenant)
        quota_need = 0 if quota is None else self.reference.used(tenant) + num_bytes - quota
        before = dict(self.reference.entries)

        self.tree.in_use = self.reference.tree.in_use = parent
        try:
            result = self.tier.admit(e, can_evict=self.tree.can_evict, remove=self.tree.remove)
            is_admitted = True
        except InsertRefused:
            is_admitted = False
        victims = self.take_removed()
        if self.IS_EXACT:
            expected_admitted, expected_victims = self.reference.admit(e)
            assert (is_admitted, victims) == (expected_admitted, expected_victims)
        else:
            self.follow(victims)
            if is_admitted:
                self.reference.record(e)
        is_too_big = num_bytes > BUDGET or (quota is not None and num_bytes > quota)
        outcome = "admitted" if is_admitted else "too big" if is_too_big else "no room"
        event(f"admit: {outcome}, {'some' if victims else 'no'} victims")
        if not is_admitted and not is_too_big:
            # Room could not be made: every block in the failed phase's scope must be stuck.
            if quota is not None and self.reference.used(tenant) + num_bytes > quota:
                self.assert_nothing_more_could_go(tenant)
            elif self.reference.used() + num_bytes > BUDGET:
                self.assert_nothing_more_could_go(None)
        self.tree.in_use = self.reference.tree.in_use = None
        if is_admitted:
            assert result.victims == tuple(victims)
            assert result.is_satisfied
            self.tree.add(e.key, parent)
            self.reference.tree.add(e.key, parent)
        else:
            assert e.key not in self.tier
        # The quota phase comes first and stops once it has freed quota_need: that prefix of
        # the victims must be the tenant's own.
        freed = 0
        for k in victims:
            if freed >= quota_need:
                break
            assert before[k].tenant == tenant, "an over-quota tenant evicted another's block"
            freed += before[k].num_bytes

    @precondition(lambda self: self.reference.entries)
    @rule(index=st.integers(min_value=0))
    def access(self, index: int) -> None:
        k = self.keys()[index % len(self.keys())]
        self.tier.access(k)
        self.reference.access(k)

    @precondition(lambda self: self.reference.entries)
    @rule(index=st.integers(min_value=0))
    def toggle_pin(self, index: int) -> None:
        k = self.keys()[index % len(self.keys())]
        for tree in (self.tree, self.reference.tree):
            tree.pinned ^= {k}

    @precondition(lambda self: self.reference.entries)
    @rule(index=st.integers(min_value=0))
    def discard_a_leaf(self, index: int) -> None:
        """A block removed by other means (say, invalidated): the owner then tells the tier."""
        leaves = [k for k in self.keys() if self.tree.can_evict(k)]
        if not leaves:
            return
        k = leaves[index % len(leaves)]
        for tree in (self.tree, self.reference.tree):
            tree.remove(k)
        self.take_removed()
        self.tier.discard(k)
        self.reference.forget(k)

    @rule(num_bytes=st.integers(0, 40), tenant=st.sampled_from((None, *TENANTS)))
    def evict(self, num_bytes: int, tenant: str | None) -> None:
        before = dict(self.reference.entries)
        result = self.tier.evict(
            num_bytes, tenant=tenant, can_evict=self.tree.can_evict, remove=self.tree.remove
        )
        victims = self.take_removed()
        if self.IS_EXACT:
            expected, _ = self.reference.evict(num_bytes, tenant)
            assert victims == expected
        else:
            self.follow(victims)
        assert result.victims == tuple(victims)
        assert result.freed_bytes == sum(before[k].num_bytes for k in victims)
        assert all(tenant in (None, before[k].tenant) for k in victims)
        assert result.is_satisfied == (result.freed_bytes >= num_bytes)
        event(f"evict: {'satisfied' if result.is_satisfied else 'unsatisfied'}")
        if not result.is_satisfied:
            self.assert_nothing_more_could_go(tenant)

    @rule()
    def sweep(self) -> None:
        result = self.tier.sweep_expired(can_evict=self.tree.can_evict, remove=self.tree.remove)
        victims = self.take_removed()
        if self.IS_EXACT:
            assert victims == self.reference.sweep()
        else:
            self.follow(victims)
        assert result.victims == tuple(victims)
        for k in self.reference.expired():
            assert not self.tree.can_evict(k), "an expired evictable block survived a sweep"

    @rule(seconds=st.sampled_from((0.5, 1.0, 2.0)))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def tier_tracks_what_the_reference_holds(self) -> None:
        assert set(self.tier.keys()) == set(self.reference.entries) == set(self.tree.parent_of)
        assert self.tier.num_entries == len(self.reference.entries)
        for k in self.tier.keys():
            assert self.tier.is_expired(k) == (k in self.reference.expired())

    @invariant()
    def usage_stays_within_budget_and_quotas(self) -> None:
        assert self.tier.used_bytes == self.reference.used() <= BUDGET
        for tenant in TENANTS:
            used = self.tier.used_bytes_of(tenant)
            assert used == self.reference.used(tenant)
            assert used <= QUOTAS.get(tenant, BUDGET)


class ClockTierMachine(TierMachine):
    ORDER = "clock"
    IS_EXACT = False


# NOTE: keep 200. At 100, seeded bugs were found less often: TTL-expired blocks not evicted
# first 0 of 6 runs (4 of 6 at 200), a read that does not refresh LRU order 1 of 6 (3 of 6).
_SETTINGS = settings(max_examples=200, stateful_step_count=50, deadline=None)
TierMachine.TestCase.settings = _SETTINGS
ClockTierMachine.TestCase.settings = _SETTINGS
TestTierMachine = TierMachine.TestCase
TestClockTierMachine = ClockTierMachine.TestCase
