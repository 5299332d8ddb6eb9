"""How many request bodies one tenant may be sending at once on the HTTP front.

Why: a request holds no call slot until its body is in (``[http] body_timeout_s`` bounds each),
so the call slots no longer bound what a tenant can hold open while it sends slowly; without a
bound of its own, one keyed client could keep every connection the front allows busy with
stalled bodies, and other tenants' requests would find none. Each tenant (all its keys together)
gets ``max_pending_bodies_per_tenant`` bodies in flight; one more is refused at once with 429
naming the setting, before anything of its body is read. Everything runs on the front's event
loop, so a plain counter needs no lock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gateway.service.http.errors import HttpFailure


class PendingBodies:
    """Bodies being received, per tenant.

    Args:
        limit: bodies one tenant may be sending at once (>= 1).
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the limit of pending bodies must be >= 1, got {limit}")
        self._limit = limit
        self._by_key: dict[str, int] = {}

    def in_flight(self, tenant: str) -> int:
        return self._by_key.get(tenant, 0)

    @contextmanager
    def hold(self, tenant: str) -> Iterator[None]:
        """One of ``tenant``'s slots while a body of its is read.

        Raises:
            HttpFailure: 429, the tenant already sends ``limit`` bodies.
        """
        key = tenant
        held = self._by_key.get(key, 0)
        if held >= self._limit:
            raise HttpFailure(
                status=429, type="rate_limit_error", code="too_many_pending_bodies",
                message=f"tenant {tenant!r} is already sending {held} request bodies; send "
                        "each body whole before starting more ([http] "
                        "max_pending_bodies_per_tenant)")
        self._by_key[key] = held + 1
        try:
            yield
        finally:
            if self._by_key[key] <= 1:
                del self._by_key[key]
            else:
                self._by_key[key] -= 1
