"""QuotaPolicy: shortfalls and refusals per tenant, and a state machine against a dict of
per-tenant sums."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from policies import BlockKey, InsertRefused, QuotaPolicy, Shortfall
from tests.policies.fakes import entry, key

TENANTS = ("a", "b", "c")


def test_a_tenant_under_its_quota_has_no_shortfall() -> None:
    policy = QuotaPolicy({"a": 10})
    policy.on_insert(entry(0, tenant="a", num_bytes=6))
    assert policy.shortfall(entry(1, tenant="a", num_bytes=4)) is None


def test_the_shortfall_is_the_excess_and_names_the_tenant() -> None:
    policy = QuotaPolicy({"a": 10})
    policy.on_insert(entry(0, tenant="a", num_bytes=6))
    assert policy.shortfall(entry(1, tenant="a", num_bytes=7)) == Shortfall(num_bytes=3, tenant="a")


def test_other_tenants_usage_does_not_count() -> None:
    policy = QuotaPolicy({"a": 10, "b": 10})
    policy.on_insert(entry(0, tenant="b", num_bytes=10))
    assert policy.shortfall(entry(1, tenant="a", num_bytes=10)) is None


def test_an_entry_larger_than_the_whole_quota_is_refused() -> None:
    policy = QuotaPolicy({"a": 10})
    with pytest.raises(InsertRefused) as refused:
        policy.shortfall(entry(0, tenant="a", num_bytes=11))
    assert str(refused.value) == (
        f"block {key(0).hex()} (11 B) is larger than the whole quota of tenant 'a' (10 B); "
        "it can never be admitted"
    )


def test_a_tenant_without_a_quota_takes_the_default() -> None:
    policy = QuotaPolicy({"a": 10}, default_bytes=4)
    assert policy.quota_of("a") == 10
    assert policy.quota_of("z") == 4
    assert policy.shortfall(entry(0, tenant="z", num_bytes=3)) is None
    with pytest.raises(InsertRefused):
        policy.shortfall(entry(0, tenant="z", num_bytes=5))


def test_without_any_quota_a_tenant_is_unlimited() -> None:
    policy = QuotaPolicy()
    assert policy.quota_of("a") is None
    assert policy.shortfall(entry(0, tenant="a", num_bytes=10**15)) is None


def test_set_quota_none_falls_back_to_the_default() -> None:
    policy = QuotaPolicy({"a": 10}, default_bytes=3)
    policy.set_quota("a", None)
    assert policy.quota_of("a") == 3
    policy.set_quota("b", 0)
    assert policy.quota_of("b") == 0


def test_lowering_a_quota_below_usage_asks_the_next_insert_to_free_the_excess() -> None:
    policy = QuotaPolicy({"a": 10})
    policy.on_insert(entry(0, tenant="a", num_bytes=8))
    policy.set_quota("a", 5)
    assert policy.used_bytes("a") == 8
    assert policy.shortfall(entry(1, tenant="a", num_bytes=1)) == Shortfall(num_bytes=4, tenant="a")


def test_removal_refunds_the_tenant() -> None:
    policy = QuotaPolicy({"a": 10})
    policy.on_insert(entry(0, tenant="a", num_bytes=8))
    policy.on_insert(entry(1, tenant="a", num_bytes=1))
    policy.on_remove(key(0))
    assert policy.used_bytes("a") == 1
    policy.on_remove(key(1))
    assert policy.used_bytes("a") == 0


def test_a_quota_offers_no_victims() -> None:
    policy = QuotaPolicy({"a": 1})
    policy.on_insert(entry(0, tenant="a", num_bytes=5))
    assert list(policy.candidates()) == []
    assert list(policy.candidates("a")) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: QuotaPolicy({"a": -1}),
        lambda: QuotaPolicy(default_bytes=-1),
        lambda: QuotaPolicy().set_quota("a", -5),
    ],
)
def test_a_negative_quota_is_a_value_error(make: object) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        make()  # type: ignore[operator]


class QuotaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = QuotaPolicy({"a": 10}, default_bytes=20)
        self.quotas: dict[str, int | None] = {"a": 10}
        self.default: int | None = 20
        self.sizes: dict[BlockKey, tuple[str, int]] = {}
        self.next_n = 0

    def used(self, tenant: str) -> int:
        return sum(size for t, size in self.sizes.values() if t == tenant)

    def quota(self, tenant: str) -> int | None:
        explicit = self.quotas.get(tenant)
        return self.default if explicit is None else explicit

    @rule(tenant=st.sampled_from(TENANTS), num_bytes=st.integers(0, 12))
    def insert(self, tenant: str, num_bytes: int) -> None:
        """Ask for the shortfall, compare with the reference, then insert regardless."""
        e = entry(self.next_n, tenant=tenant, num_bytes=num_bytes)
        self.next_n += 1
        quota = self.quota(tenant)
        if quota is not None and num_bytes > quota:
            with pytest.raises(InsertRefused):
                self.policy.shortfall(e)
        else:
            excess = None if quota is None else self.used(tenant) + num_bytes - quota
            expected = Shortfall(num_bytes=excess, tenant=tenant) if excess and excess > 0 else None
            assert self.policy.shortfall(e) == expected
        self.policy.on_insert(e)
        self.sizes[e.key] = (tenant, num_bytes)

    @precondition(lambda self: self.sizes)
    @rule(index=st.integers(min_value=0))
    def remove(self, index: int) -> None:
        k = list(self.sizes)[index % len(self.sizes)]
        self.policy.on_remove(k)
        del self.sizes[k]

    @rule(tenant=st.sampled_from(TENANTS), num_bytes=st.one_of(st.none(), st.integers(0, 25)))
    def set_quota(self, tenant: str, num_bytes: int | None) -> None:
        self.policy.set_quota(tenant, num_bytes)
        self.quotas[tenant] = num_bytes

    @invariant()
    def usage_and_quotas_match(self) -> None:
        for tenant in TENANTS:
            assert self.policy.used_bytes(tenant) == self.used(tenant)
            assert self.policy.quota_of(tenant) == self.quota(tenant)


# NOTE: 75 examples (150 until the suite was trimmed): seeded bugs (one byte over the quota
# admitted, a block of exactly the quota refused, a quota freed from other tenants' blocks) were
# each found in every one of 8 runs at 75, as at 150.
QuotaMachine.TestCase.settings = settings(max_examples=75, stateful_step_count=40, deadline=None)
TestQuotaMachine = QuotaMachine.TestCase
