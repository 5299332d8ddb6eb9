"""Per-tenant rates: a token bucket for each tenant, so one tenant's bursts spend only its own.

Two places need "at most R units per second per tenant, with bursts up to B": the service's
Lookup rate per key (units: calls) and the remote tier's write budget (units: bytes written to
Redis, so that one tenant's warm flood cannot fill the shared Redis and push the others' blocks
out). Like every policy here it sees tenants, numbers and time only; time is injected.

A bucket holds up to ``burst`` units and refills at ``rate_per_s``; ``try_take(tenant, n)``
takes ``n`` units if they are there and says whether it did. It never waits: the caller decides
what a refusal means (RESOURCE_EXHAUSTED for a call, a dropped write for the remote tier).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    level: float
    updated: float


class TenantRates:
    """A token bucket per tenant; thread-safe.

    Args:
        rate_per_s: units each tenant earns per second.
        burst: the most units a tenant can hold (and so spend at once).
        clock: monotonic seconds.
        max_tenants: buckets kept at most; when more tenants appear, full buckets (those that
            would behave as new ones) are forgotten first, so the table cannot grow without
            bound while every tenant keeps its limit.

    Raises:
        ValueError: a rate, burst or size that is not positive.
    """

    def __init__(self, rate_per_s: float, burst: float, *,
                 clock: Callable[[], float] = time.monotonic, max_tenants: int = 10_000) -> None:
        if not (math.isfinite(rate_per_s) and rate_per_s > 0):
            raise ValueError(f"rate_per_s must be a positive number, got {rate_per_s!r}")
        if not (math.isfinite(burst) and burst > 0):
            raise ValueError(f"burst must be a positive number, got {burst!r}")
        if max_tenants < 1:
            raise ValueError(f"max_tenants must be >= 1, got {max_tenants}")
        self._rate = float(rate_per_s)
        self._burst = float(burst)
        self._clock = clock
        self._max_tenants = max_tenants
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    @property
    def rate_per_s(self) -> float:
        return self._rate

    @property
    def burst(self) -> float:
        return self._burst

    def try_take(self, tenant: str, amount: float = 1.0) -> bool:
        """Take ``amount`` units from ``tenant``'s bucket if it holds them; whether it did.

        An amount larger than the burst can never be taken whole: it is allowed from a full
        bucket (leaving it empty, so the tenant then waits out the excess), so that one large
        item is slowed, not refused forever.
        """
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                self._make_room()
                bucket = self._buckets[tenant] = _Bucket(level=self._burst, updated=now)
            else:
                elapsed = max(0.0, now - bucket.updated)
                bucket.level = min(self._burst, bucket.level + elapsed * self._rate)
                bucket.updated = now
            if amount <= bucket.level:
                bucket.level -= amount
                return True
            if amount > self._burst and bucket.level >= self._burst:
                bucket.level = self._burst - amount  # negative: the excess is paid back later
                return True
            return False

    def seconds_until(self, tenant: str, amount: float = 1.0) -> float:
        """How long until ``tenant`` could take ``amount`` (0 if it can now); for messages."""
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                return 0.0
            level = min(self._burst, bucket.level + max(0.0, now - bucket.updated) * self._rate)
        need = min(amount, self._burst) - level
        return max(0.0, need / self._rate)

    def _make_room(self) -> None:
        if len(self._buckets) < self._max_tenants:
            return
        now = self._clock()
        for tenant, bucket in list(self._buckets.items()):
            if bucket.level + (now - bucket.updated) * self._rate >= self._burst:
                del self._buckets[tenant]
        if len(self._buckets) >= self._max_tenants:  # none full: forget the oldest update
            oldest = min(self._buckets, key=lambda t: self._buckets[t].updated)
            del self._buckets[oldest]
