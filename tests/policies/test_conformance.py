"""The ``EvictionPolicy`` contract, checked against every implementation.

Each implementation is described by how to build it and whether it *ranks* (offers every
tracked key as a victim once it is due: LRU, CLOCK, and TTL after expiry) or only *limits*
(quota and budget offer nothing). The same tests then run against all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from policies import (
    ORDER_POLICIES,
    BudgetPolicy,
    ClockPolicy,
    EvictionPolicy,
    LRUPolicy,
    QuotaPolicy,
    TTLPolicy,
)
from tests.policies.fakes import FakeClock, entry, key


@dataclass(frozen=True)
class Impl:
    name: str
    make: Callable[[FakeClock], EvictionPolicy]
    ranks: bool
    ttl_s: float | None = None  # given to every entry; the clock is then moved past it


def _order_impl(name: str, factory: Callable[[], EvictionPolicy]) -> Impl:
    return Impl(name, lambda clock: factory(), ranks=True)


# Every registered order policy, so a new one is checked by adding its registry line.
IMPLS = [
    *(_order_impl(name, factory) for name, factory in sorted(ORDER_POLICIES.items())),
    Impl("ttl", lambda clock: TTLPolicy(clock=clock), ranks=True, ttl_s=1.0),
    Impl("quota", lambda clock: QuotaPolicy(default_bytes=1_000), ranks=False),
    Impl("budget", lambda clock: BudgetPolicy(1_000), ranks=False),
]


@dataclass
class Harness:
    impl: Impl
    clock: FakeClock
    policy: EvictionPolicy

    def insert(self, n: int, tenant: str = "t") -> None:
        self.policy.on_insert(entry(n, tenant=tenant, ttl_s=self.impl.ttl_s))

    def candidates(self, tenant: str | None = None) -> list[int]:
        """Every candidate, as key numbers, once all tracked keys are due."""
        if self.impl.ttl_s is not None:
            self.clock.advance(self.impl.ttl_s)
        return [int.from_bytes(k, "big") for k in self.policy.candidates(tenant)]


@pytest.fixture(params=IMPLS, ids=[impl.name for impl in IMPLS])
def harness(request: pytest.FixtureRequest) -> Harness:
    clock = FakeClock()
    impl: Impl = request.param
    return Harness(impl=impl, clock=clock, policy=impl.make(clock))


def test_is_a_runtime_checkable_eviction_policy(harness: Harness) -> None:
    assert isinstance(harness.policy, EvictionPolicy)


def test_the_suite_covers_the_known_order_policies() -> None:
    assert {type(impl.make(FakeClock())) for impl in IMPLS} >= {LRUPolicy, ClockPolicy}


def test_empty_policy_offers_nothing(harness: Harness) -> None:
    assert harness.candidates() == []


def test_offers_each_tracked_key_once_and_nothing_else(harness: Harness) -> None:
    for n in range(5):
        harness.insert(n)
    offered = harness.candidates()
    assert len(offered) == len(set(offered))
    assert sorted(offered) == (list(range(5)) if harness.impl.ranks else [])


def test_never_offers_a_removed_key(harness: Harness) -> None:
    for n in range(5):
        harness.insert(n)
    harness.policy.on_remove(key(0))
    harness.policy.on_remove(key(3))
    offered = harness.candidates()
    assert 0 not in offered and 3 not in offered
    assert sorted(offered) == ([1, 2, 4] if harness.impl.ranks else [])


def test_tenant_filter_offers_only_that_tenants_keys(harness: Harness) -> None:
    for n, tenant in zip(range(6), itertools.cycle("ab")):
        harness.insert(n, tenant=tenant)
    offered = harness.candidates("a")
    assert sorted(offered) == ([0, 2, 4] if harness.impl.ranks else [])


def test_unknown_tenant_is_offered_nothing(harness: Harness) -> None:
    harness.insert(0, tenant="a")
    assert harness.candidates("nobody") == []


def test_accessed_keys_are_still_offered(harness: Harness) -> None:
    for n in range(3):
        harness.insert(n)
    harness.policy.on_access(key(1))
    assert sorted(harness.candidates()) == ([0, 1, 2] if harness.impl.ranks else [])


def test_a_key_taken_from_a_closed_iterator_can_be_removed(harness: Harness) -> None:
    for n in range(3):
        harness.insert(n)
    if harness.impl.ttl_s is not None:
        harness.clock.advance(harness.impl.ttl_s)
    iterator = harness.policy.candidates()
    first = next(iterator, None)
    getattr(iterator, "close", lambda: None)()
    if first is not None:
        harness.policy.on_remove(first)
        assert first not in list(harness.policy.candidates())


def test_a_removed_key_may_be_inserted_again(harness: Harness) -> None:
    harness.insert(0)
    harness.policy.on_remove(key(0))
    harness.insert(0)
    assert harness.candidates() == ([0] if harness.impl.ranks else [])


def test_inserting_a_tracked_key_is_a_value_error(harness: Harness) -> None:
    harness.insert(0)
    with pytest.raises(ValueError, match="already tracked"):
        harness.insert(0)


def test_accessing_an_untracked_key_is_a_key_error(harness: Harness) -> None:
    with pytest.raises(KeyError):
        harness.policy.on_access(key(7))


def test_removing_an_untracked_key_is_a_key_error(harness: Harness) -> None:
    harness.insert(0)
    harness.policy.on_remove(key(0))
    with pytest.raises(KeyError):
        harness.policy.on_remove(key(0))


def test_a_small_entry_fits_an_empty_policy(harness: Harness) -> None:
    assert harness.policy.shortfall(entry(0, num_bytes=10)) is None
