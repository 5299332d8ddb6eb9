"""Per-key admission (``gateway.service.admission``) without a server: every limit, named."""

from __future__ import annotations

import pytest

from gateway.config.keys import Principal
from gateway.config.limits import LimitSettings
from gateway.service.admission import Admission, CallKind, Overloaded

A = Principal(tenant="tenant-a")
B = Principal(tenant="tenant-b")
OPS = Principal(tenant="tenant-a", is_admin=True)  # an admin named like a tenant


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_over_its_calls_is_refused_while_another_key_is_admitted() -> None:
    admission = Admission(LimitSettings(max_calls=4, max_calls_per_key=2, max_lookups=2,
                                        max_lookups_per_key=1))
    leases = [admission.admit(A, CallKind.GENERATE) for _ in range(2)]
    with pytest.raises(Overloaded, match="tenant .tenant-a. already has 2 calls"):
        admission.admit(A, CallKind.GENERATE)
    admission.admit(B, CallKind.GENERATE)
    admission.admit(OPS, CallKind.ADMIN)  # counted apart from the tenant of the same name
    with pytest.raises(Overloaded, match="limits.max_calls"):
        admission.admit(B, CallKind.GENERATE)
    leases[0].release()
    leases[0].release()  # once only
    assert admission.snapshot().calls == 3
    admission.admit(A, CallKind.GENERATE)


def test_lookups_are_bounded_in_flight_per_key_and_in_total() -> None:
    admission = Admission(LimitSettings(max_calls=8, max_calls_per_key=8, max_lookups=3,
                                        max_lookups_per_key=2))
    admission.admit(A, CallKind.LOOKUP)
    admission.admit(A, CallKind.LOOKUP)
    with pytest.raises(Overloaded, match="max_lookups_per_key"):
        admission.admit(A, CallKind.LOOKUP)
    admission.admit(A, CallKind.GENERATE)  # other calls are not lookups
    admission.admit(B, CallKind.LOOKUP)
    with pytest.raises(Overloaded, match="limits.max_lookups\\)"):
        admission.admit(Principal(tenant="tenant-c"), CallKind.LOOKUP)


def test_the_lookup_rate_is_per_key() -> None:
    clock = FakeClock()
    admission = Admission(LimitSettings(lookups_per_s=2.0, lookup_burst=2), clock=clock)
    for _ in range(2):
        admission.admit(A, CallKind.LOOKUP).release()
    with pytest.raises(Overloaded, match="more than 2 Lookups per second.*retry in 0.500 s"):
        admission.admit(A, CallKind.LOOKUP)
    admission.admit(B, CallKind.LOOKUP).release()
    admission.admit(OPS, CallKind.LOOKUP).release()
    clock.now = 0.5
    admission.admit(A, CallKind.LOOKUP).release()


def test_warm_calls_in_flight_are_bounded_per_key() -> None:
    admission = Admission(LimitSettings(max_warms_per_key=1))
    with admission.admit(A, CallKind.WARM):
        with pytest.raises(Overloaded, match="max_warms_per_key"):
            admission.admit(A, CallKind.WARM)
        admission.admit(B, CallKind.WARM).release()
    admission.admit(A, CallKind.WARM).release()
    assert admission.snapshot().calls == 0


def test_inconsistent_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_calls_per_key"):
        Admission(LimitSettings(max_calls=4, max_calls_per_key=5, max_lookups=2,
                                max_lookups_per_key=1))
