"""A circuit breaker: stop calling a remote store that keeps failing, probe it now and then.

Without one, every request pays a full socket timeout while Redis is down (peers stalled every
prefill for 250 ms this way). With one, a dead tier costs nothing: after ``failure_threshold``
consecutive failures the breaker *opens* and ``allow()`` answers False at once; after
``reset_after_s`` it turns *half-open* and lets exactly one probe call through; the probe's
success closes it, its failure opens it for another ``reset_after_s``.

State diagram::

    closed ──N consecutive failures / trip()──▶ open ──reset_after_s──▶ half_open
      ▲                                           ▲                        │
      └────────────── probe succeeds ─────────────┼──── probe fails ───────┘

The breaker knows nothing of Redis: callers ask ``allow()`` before a call and report the outcome
with ``record_success()`` / ``record_failure()``. It is thread-safe; the clock is injected so
tests move time instead of sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Counts consecutive failures of one remote dependency and gates calls to it.

    Args:
        failure_threshold: consecutive failures that open a closed breaker (>= 1).
        reset_after_s: how long an open breaker refuses calls before one probe may go (> 0).
        clock: monotonic seconds; injected for tests.

    NOTE: a probe whose caller never reports back (it crashed between ``allow()`` and
    ``record_*``) would leave the breaker half-open with nobody allowed through; so a probe
    that has been out for ``reset_after_s`` is treated as lost and the next caller probes again.
    """

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        reset_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not reset_after_s > 0:
            raise ValueError(f"reset_after_s must be > 0, got {reset_after_s}")
        self.failure_threshold = failure_threshold
        self.reset_after_s = reset_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: BreakerState = "closed"
        self._num_failures = 0
        self._opened_at = 0.0
        self._probe_started_at = 0.0

    @property
    def state(self) -> BreakerState:
        """ "closed", "open" (calls refused), or "half_open" (a probe may go, or is out)."""
        with self._lock:
            if self._state == "open" and self._clock() - self._opened_at >= self.reset_after_s:
                return "half_open"
            return self._state

    def allow(self) -> bool:
        """Whether the caller may make a call now; a True in half-open makes it the probe."""
        with self._lock:
            if self._state == "closed":
                return True
            now = self._clock()
            if self._state == "open":
                if now - self._opened_at < self.reset_after_s:
                    return False
            elif now - self._probe_started_at < self.reset_after_s:
                return False  # half-open, and the probe is still out
            self._state = "half_open"
            self._probe_started_at = now
            return True

    def record_success(self) -> None:
        """The dependency answered: close the breaker and forget past failures."""
        with self._lock:
            self._state = "closed"
            self._num_failures = 0

    def record_failure(self) -> None:
        """A call failed: count it; open the breaker at the threshold or if a probe failed."""
        with self._lock:
            if self._state == "half_open":
                self._open()
            elif self._state == "closed":
                self._num_failures += 1
                if self._num_failures >= self.failure_threshold:
                    self._open()
            # NOTE: a failure reported while already open (a call admitted before the breaker
            # opened) does not push the reopening further away.

    def trip(self) -> None:
        """Open now, whatever the count: for faults that retrying soon cannot fix (bad auth)
        or a dependency known to be down (unreachable at start)."""
        with self._lock:
            self._open()

    def _open(self) -> None:
        self._state = "open"
        self._opened_at = self._clock()
        self._num_failures = 0
