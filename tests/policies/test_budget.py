"""BudgetPolicy: the tier-wide byte limit."""

from __future__ import annotations

import pytest

from policies import BudgetPolicy, InsertRefused, Shortfall
from tests.policies.fakes import entry, key


def test_an_entry_that_fits_has_no_shortfall() -> None:
    policy = BudgetPolicy(10)
    policy.on_insert(entry(0, num_bytes=6))
    assert policy.shortfall(entry(1, num_bytes=4)) is None


def test_the_shortfall_is_the_excess_from_any_tenant() -> None:
    policy = BudgetPolicy(10)
    policy.on_insert(entry(0, tenant="a", num_bytes=6))
    policy.on_insert(entry(1, tenant="b", num_bytes=3))
    assert policy.shortfall(entry(2, tenant="c", num_bytes=5)) == Shortfall(
        num_bytes=4, tenant=None
    )


def test_an_entry_larger_than_the_whole_budget_is_refused() -> None:
    policy = BudgetPolicy(10)
    with pytest.raises(InsertRefused) as refused:
        policy.shortfall(entry(0, num_bytes=11))
    assert str(refused.value) == (
        f"block {key(0).hex()} (11 B) is larger than the tier's whole budget (10 B); "
        "it can never be admitted"
    )


def test_used_bytes_follow_inserts_and_removals() -> None:
    policy = BudgetPolicy(10)
    policy.on_insert(entry(0, num_bytes=6))
    policy.on_insert(entry(1, num_bytes=3))
    policy.on_remove(key(0))
    assert policy.used_bytes == 3
    assert policy.budget_bytes == 10


def test_a_zero_budget_admits_only_empty_entries() -> None:
    policy = BudgetPolicy(0)
    assert policy.shortfall(entry(0, num_bytes=0)) is None
    with pytest.raises(InsertRefused):
        policy.shortfall(entry(0, num_bytes=1))


def test_a_budget_offers_no_victims() -> None:
    policy = BudgetPolicy(1)
    policy.on_insert(entry(0, num_bytes=1))
    assert list(policy.candidates()) == []


def test_a_negative_budget_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="budget_bytes must be >= 0, got -1"):
        BudgetPolicy(-1)
