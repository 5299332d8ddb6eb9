"""ClockPolicy: exact second-chance orders and hand positions, and a state machine against a
reference ring kept as a plain list, a hand index and a dict of reference bits."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from policies import BlockKey, ClockPolicy
from tests.policies.fakes import entry, key

TENANTS = ("a", "b")


def take(policy: ClockPolicy, num: int, tenant: str | None = None) -> list[BlockKey]:
    """The first ``num`` victims, closing the search afterwards (as TierPolicy does)."""
    iterator = policy.candidates(tenant)
    try:
        return list(itertools.islice(iterator, num))
    finally:
        getattr(iterator, "close", lambda: None)()


def clock_with(*tenants: str) -> ClockPolicy:
    policy = ClockPolicy()
    for n, tenant in enumerate(tenants):
        policy.on_insert(entry(n, tenant=tenant))
    return policy


def test_unreferenced_blocks_are_offered_in_ring_order_from_the_hand() -> None:
    policy = clock_with("t", "t", "t")
    assert policy.hand == key(0)
    assert take(policy, 10) == [key(0), key(1), key(2)]


def test_a_referenced_block_gets_a_second_chance() -> None:
    policy = clock_with("t", "t", "t")
    policy.on_access(key(1))
    # 0 is offered, 1 has its bit cleared, 2 is offered, the hand comes round and offers 1.
    assert take(policy, 10) == [key(0), key(2), key(1)]
    assert not policy.is_referenced(key(1))


def test_the_hand_stops_just_past_the_last_victim_taken() -> None:
    policy = clock_with("t", "t", "t", "t")
    policy.on_access(key(0))
    assert take(policy, 1) == [key(1)]
    assert policy.hand == key(2)
    assert not policy.is_referenced(key(0))  # cleared on the way
    assert take(policy, 1) == [key(2)]
    assert policy.hand == key(3)


def test_a_new_block_goes_just_behind_the_hand() -> None:
    policy = clock_with("t", "t", "t")
    take(policy, 1)  # offers 0; the hand moves to 1
    policy.on_insert(entry(9))
    assert policy.ring() == [key(1), key(2), key(0), key(9)]
    assert take(policy, 10) == [key(1), key(2), key(0), key(9)]


def test_a_new_block_starts_unreferenced() -> None:
    policy = clock_with("t")
    assert not policy.is_referenced(key(0))


def test_removing_the_block_under_the_hand_moves_the_hand_to_its_successor() -> None:
    policy = clock_with("t", "t", "t")
    policy.on_remove(key(0))
    assert policy.hand == key(1)
    assert policy.ring() == [key(1), key(2)]


def test_removing_the_last_block_empties_the_ring() -> None:
    policy = clock_with("t")
    policy.on_remove(key(0))
    assert policy.hand is None
    assert policy.ring() == []
    assert take(policy, 10) == []


def test_a_tenant_search_passes_other_tenants_untouched() -> None:
    policy = clock_with("a", "b", "a", "b")
    policy.on_access(key(1))
    policy.on_access(key(2))
    assert take(policy, 10, tenant="a") == [key(0), key(2)]
    assert policy.is_referenced(key(1))  # b's bit is kept for b
    assert take(policy, 10) == [key(3), key(0), key(2), key(1)]


def test_a_search_with_everything_referenced_clears_then_offers_in_order() -> None:
    policy = clock_with("t", "t", "t")
    for n in range(3):
        policy.on_access(key(n))
    assert take(policy, 10) == [key(0), key(1), key(2)]


def test_a_search_over_the_wrong_tenant_ends_without_moving_bits() -> None:
    policy = clock_with("a", "a")
    policy.on_access(key(0))
    assert take(policy, 10, tenant="b") == []
    assert policy.is_referenced(key(0))


def test_clock_never_reports_a_shortfall() -> None:
    policy = clock_with("t")
    assert policy.shortfall(entry(1, num_bytes=10**12)) is None


class ReferenceClock:
    """The same algorithm over a Python list: indices instead of links."""

    def __init__(self) -> None:
        self.ring: list[BlockKey] = []
        self.hand = 0
        self.bits: dict[BlockKey, bool] = {}
        self.tenants: dict[BlockKey, str] = {}

    def insert(self, k: BlockKey, tenant: str) -> None:
        self.ring.insert(self.hand, k)  # just behind the hand
        if len(self.ring) > 1:
            self.hand += 1
        self.bits[k] = False
        self.tenants[k] = tenant

    def remove(self, k: BlockKey) -> None:
        index = self.ring.index(k)
        del self.ring[index], self.bits[k], self.tenants[k]
        if index < self.hand:
            self.hand -= 1
        if self.hand >= len(self.ring):
            self.hand = 0

    def candidates(self, tenant: str | None) -> Iterator[BlockKey]:
        yielded: set[BlockKey] = set()
        num_idle = 0
        while self.ring and num_idle < len(self.ring):
            k = self.ring[self.hand]
            self.hand = (self.hand + 1) % len(self.ring)
            if (tenant is not None and self.tenants[k] != tenant) or k in yielded:
                num_idle += 1
            elif self.bits[k]:
                self.bits[k] = False
                num_idle = 0
            else:
                num_idle = 0
                yielded.add(k)
                yield k

    def from_hand(self) -> list[BlockKey]:
        return self.ring[self.hand :] + self.ring[: self.hand]


class ClockMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = ClockPolicy()
        self.reference = ReferenceClock()
        self.next_n = 0

    @rule(tenant=st.sampled_from(TENANTS))
    def insert(self, tenant: str) -> None:
        e = entry(self.next_n, tenant=tenant)
        self.next_n += 1
        self.policy.on_insert(e)
        self.reference.insert(e.key, tenant)

    @precondition(lambda self: self.reference.ring)
    @rule(index=st.integers(min_value=0))
    def access(self, index: int) -> None:
        k = self.reference.ring[index % len(self.reference.ring)]
        self.policy.on_access(k)
        self.reference.bits[k] = True

    @precondition(lambda self: self.reference.ring)
    @rule(index=st.integers(min_value=0))
    def remove(self, index: int) -> None:
        k = self.reference.ring[index % len(self.reference.ring)]
        self.policy.on_remove(k)
        self.reference.remove(k)

    @rule(num=st.integers(min_value=0, max_value=6), tenant=st.sampled_from((None, *TENANTS)))
    def search(self, num: int, tenant: str | None) -> None:
        expected = list(itertools.islice(self.reference.candidates(tenant), num))
        assert take(self.policy, num, tenant) == expected

    @precondition(lambda self: self.reference.ring)
    @rule(data=st.data(), tenant=st.sampled_from((None, *TENANTS)))
    def evict_some_searched(self, data: st.DataObject, tenant: str | None) -> None:
        """Take victims, then remove a few of them, as TierPolicy does after closing."""
        victims = take(self.policy, 3, tenant)
        assert victims == list(itertools.islice(self.reference.candidates(tenant), 3))
        for k in data.draw(st.lists(st.sampled_from(victims), unique=True)) if victims else []:
            self.policy.on_remove(k)
            self.reference.remove(k)

    @invariant()
    def ring_hand_and_bits_match_the_reference(self) -> None:
        assert self.policy.ring() == self.reference.from_hand()
        for k in self.reference.ring:
            assert self.policy.is_referenced(k) == self.reference.bits[k]


# NOTE: 75 examples (150 until the suite was trimmed): seeded bugs (a read that sets no
# reference bit, new blocks linked at the hand, the hand stepping back on a removal) were each
# found in every one of 8+ runs at 75, as at 150.
ClockMachine.TestCase.settings = settings(max_examples=75, stateful_step_count=40, deadline=None)
TestClockMachine = ClockMachine.TestCase
