"""Per-key admission: how much of the gateway one authenticated caller may hold at once.

docs/reliability.md, threat 5. A front (the gRPC server today, an HTTP front tomorrow) calls
``Admission.admit(principal, kind)`` *after* it has authenticated the call and *before* it
spends anything on it (a worker thread, tokenising, the engine's queue). Admission either
returns a ``CallSlot`` -- released exactly once when the call ends, however it ends -- or raises
``Overloaded`` (RESOURCE_EXHAUSTED) at once, naming the limit; it never waits. The bounds
(``gateway.config.limits.LimitSettings``):

- calls in flight: all keys together (``max_calls``, which is also the size of the worker pool,
  so an admitted call never waits for a thread) and per key (``max_calls_per_key``);
- Lookups (which tokenise on the caller's thread) in flight, all keys and per key, and a
  Lookup rate per key (``policies.rate.TenantRates``);
- Warm calls in flight per key.

Running and queued generations per tenant are bounded by the engine's scheduler
(``[engine] max_running_per_tenant``, ``max_queued_per_tenant``); this module does not repeat
them. Keys are counted by their principal (tenant, or admin name), so two keys of one tenant
share its bounds.

Usage from any front::

    slot = admission.admit(principal, CallKind.LOOKUP)   # raises Overloaded
    try:
        ...serve the call...
    finally:
        slot.release()                                     # idempotent

or ``with admission.admit(principal, kind): ...``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from gateway.config.keys import Principal
from gateway.config.limits import LimitSettings
from gateway.core.errors import QueueFull
from policies.rate import TenantRates


class Overloaded(QueueFull):
    """A per-key or server-wide admission limit is reached (RESOURCE_EXHAUSTED); retry later."""


class CallKind(enum.Enum):
    """What a call will do, for the limits that apply to it."""

    GENERATE = "generate"
    WARM = "warm"
    LOOKUP = "lookup"
    ADMIN = "admin"
    OTHER = "other"


@dataclass(slots=True)
class _Counts:
    calls: int = 0
    lookups: int = 0
    warms: int = 0


@dataclass(slots=True, kw_only=True)
class CallSlot:
    """One admitted call's share; ``release`` gives it back (once, whoever calls it first)."""

    principal: Principal
    kind: CallKind
    _admission: Admission = field(repr=False)
    _is_released: bool = False

    def release(self) -> None:
        self._admission._release(self)

    @property
    def is_released(self) -> bool:
        return self._is_released

    def __enter__(self) -> CallSlot:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionSnapshot:
    """Calls in flight now (for tests and stats)."""

    calls: int
    lookups: int
    calls_by_principal: dict[str, int]


class Admission:
    """Counts of calls in flight per principal and in total; the Lookup rate per principal.

    Args:
        limits: the bounds.
        clock: monotonic seconds (the Lookup rate's token buckets).
    """

    def __init__(self, limits: LimitSettings, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        problems = limits.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self._limits = limits
        self._lock = threading.Lock()
        self._total = _Counts()
        self._by_principal: dict[Principal, _Counts] = {}
        self._lookup_rate = TenantRates(limits.lookups_per_s, limits.lookup_burst, clock=clock)

    @property
    def limits(self) -> LimitSettings:
        return self._limits

    def admit(self, principal: Principal, kind: CallKind) -> CallSlot:
        """Admit one call of ``principal``, or refuse it at once.

        Raises:
            Overloaded: a limit is reached; the message names it and what to do.
        """
        limits = self._limits
        with self._lock:
            mine = self._by_principal.get(principal) or _Counts()
            who = _who(principal)
            if mine.calls >= limits.max_calls_per_key:
                raise Overloaded(
                    f"{who} already has {mine.calls} calls in flight "
                    f"(limits.max_calls_per_key = {limits.max_calls_per_key}); wait for some "
                    "to finish")
            if self._total.calls >= limits.max_calls:
                raise Overloaded(
                    f"the gateway is serving {self._total.calls} calls (limits.max_calls); "
                    "retry shortly or on another replica")
            if kind is CallKind.LOOKUP:
                if mine.lookups >= limits.max_lookups_per_key:
                    raise Overloaded(
                        f"{who} already has {mine.lookups} Lookups in flight "
                        f"(limits.max_lookups_per_key = {limits.max_lookups_per_key})")
                if self._total.lookups >= limits.max_lookups:
                    raise Overloaded(
                        f"{self._total.lookups} Lookups are in flight (limits.max_lookups); "
                        "retry shortly")
                if not self._lookup_rate.try_take(_rate_key(principal)):
                    wait = self._lookup_rate.seconds_until(_rate_key(principal))
                    raise Overloaded(
                        f"{who} sends more than {limits.lookups_per_s:g} Lookups per second "
                        f"(limits.lookups_per_s); retry in {max(wait, 0.001):.3f} s")
            if kind is CallKind.WARM and mine.warms >= limits.max_warms_per_key:
                raise Overloaded(
                    f"{who} already has {mine.warms} Warm calls in flight "
                    f"(limits.max_warms_per_key = {limits.max_warms_per_key}); warm one "
                    "prompt after another")
            self._by_principal[principal] = mine
            for counts in (mine, self._total):
                counts.calls += 1
                counts.lookups += kind is CallKind.LOOKUP
                counts.warms += kind is CallKind.WARM
        return CallSlot(principal=principal, kind=kind, _admission=self)

    def snapshot(self) -> AdmissionSnapshot:
        with self._lock:
            return AdmissionSnapshot(
                calls=self._total.calls, lookups=self._total.lookups,
                calls_by_principal={_who(p): c.calls for p, c in self._by_principal.items()})

    def _release(self, slot: CallSlot) -> None:
        with self._lock:
            if slot._is_released:
                return
            slot._is_released = True
            mine = self._by_principal[slot.principal]
            for counts in (mine, self._total):
                counts.calls -= 1
                counts.lookups -= slot.kind is CallKind.LOOKUP
                counts.warms -= slot.kind is CallKind.WARM
            if mine.calls == 0:
                del self._by_principal[slot.principal]


def _who(principal: Principal) -> str:
    return (f"admin key {principal.tenant!r}" if principal.is_admin
            else f"tenant {principal.tenant!r}")


def _rate_key(principal: Principal) -> str:
    # NOTE: framed so that an admin named like a tenant never shares the tenant's bucket.
    return ("admin:" if principal.is_admin else "tenant:") + principal.tenant
