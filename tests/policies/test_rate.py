"""Per-tenant token buckets: a tenant spends only its own budget; time is a fake clock."""

from __future__ import annotations

import pytest

from policies.rate import TenantRates


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_may_spend_its_burst_at_once_then_its_rate() -> None:
    clock = FakeClock()
    rates = TenantRates(10.0, 5, clock=clock)
    assert [rates.try_take("a") for _ in range(6)] == [True] * 5 + [False]
    clock.now = 0.1  # one unit earned
    assert rates.try_take("a") and not rates.try_take("a")
    assert rates.seconds_until("a") == pytest.approx(0.1)


def test_one_tenant_spending_does_not_spend_another() -> None:
    rates = TenantRates(1.0, 3, clock=FakeClock())
    assert all(rates.try_take("flood") for _ in range(3))
    assert not rates.try_take("flood")
    assert all(rates.try_take("quiet") for _ in range(3))


def test_a_bucket_never_holds_more_than_its_burst() -> None:
    clock = FakeClock()
    rates = TenantRates(100.0, 2, clock=clock)
    rates.try_take("a")
    clock.now = 1000.0
    assert [rates.try_take("a") for _ in range(3)] == [True, True, False]


def test_bytes_larger_than_the_burst_pass_from_a_full_bucket_and_are_paid_back() -> None:
    clock = FakeClock()
    rates = TenantRates(1000.0, 1000, clock=clock)
    assert rates.try_take("a", 3000)  # from a full bucket: allowed, now 2000 in debt
    clock.now = 1.0
    assert not rates.try_take("a", 1)  # still paying back
    clock.now = 3.0
    assert rates.try_take("a", 1000)


def test_the_table_of_tenants_is_bounded() -> None:
    clock = FakeClock()
    rates = TenantRates(1.0, 1, clock=clock, max_tenants=2)
    assert rates.try_take("a") and rates.try_take("b") and rates.try_take("c")
    assert not rates.try_take("c")  # c keeps its (empty) bucket: the oldest was forgotten


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (1, 0), (float("nan"), 1), (1, -1)])
def test_rates_and_bursts_must_be_positive(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TenantRates(rate, burst)
