"""What the Redis tier does when Redis fails: count the fault, tell the breaker, warn once.

Split from ``tiers.redis_store`` (whose rule is "an outage is a miss") so that the store reads
as what it stores and how, and this module as the bookkeeping of failures: errors counted by
kind, the circuit breaker told of every success and failure, one warning per outage (and one
line when Redis is back), and every message scrubbed of the URL's password.
"""

from __future__ import annotations

import logging
import threading
import time

from redis.exceptions import DataError, OutOfMemoryError

from tiers.breaker import CircuitBreaker
from tiers.redis_client import AUTH_FAULTS

logger = logging.getLogger(__name__.rsplit(".", 1)[0] + ".redis_store")


class RedisFaults:
    """The Redis tier's failure bookkeeping (thread-safe).

    Args:
        breaker: gates calls while Redis keeps failing.
        where: the Redis, as log lines name it (a redacted URL).
        secrets: strings never to log (the URL's password, raw and percent-encoded).
    """

    def __init__(self, breaker: CircuitBreaker, *, where: str,
                 secrets: tuple[str, ...]) -> None:
        self.breaker = breaker
        self.where = where
        self._secrets = secrets
        self._lock = threading.Lock()
        self.num_errors = 0
        self.errors_by_kind: dict[str, int] = {}
        self.last_rtt_ms = 0.0
        self._is_in_outage = False  # an outage warning was logged and not yet followed by success

    def on_success(self, began: float) -> None:
        """A call that started at ``began`` (``time.perf_counter``) succeeded."""
        self.breaker.record_success()
        with self._lock:
            self.last_rtt_ms = (time.perf_counter() - began) * 1000.0
            was_in_outage, self._is_in_outage = self._is_in_outage, False
        if was_in_outage:
            logger.info("redis tier at %s is available again", self.where)

    def on_fault(self, exc: BaseException) -> None:
        """Count a Redis fault, tell the breaker, and warn once per outage.

        Raises:
            DataError: ``exc`` is one: bad arguments from us, a bug.
        """
        if isinstance(exc, DataError):
            raise exc
        self.count(exc)
        if isinstance(exc, OutOfMemoryError):
            # Redis answered but is full (maxmemory with noeviction): writes fail, reads work,
            # so this is no reason to stop reading.
            self.breaker.record_success()
            logger.debug("redis tier at %s is full: %s", self.where, self.describe(exc))
            return
        if isinstance(exc, AUTH_FAULTS):
            self.breaker.trip()
        else:
            self.breaker.record_failure()
        if self.breaker.state != "closed":
            self.enter_outage(exc)
        else:
            logger.debug("redis call failed: %s", self.describe(exc))

    def count(self, exc: BaseException) -> None:
        kind = type(exc).__name__
        with self._lock:
            self.num_errors += 1
            self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1

    def enter_outage(self, exc: BaseException) -> None:
        """Warn that the tier is off, once per outage."""
        with self._lock:
            if self._is_in_outage:
                return
            self._is_in_outage = True
        if isinstance(exc, AUTH_FAULTS):
            why = "authentication failed (check the user and password in the Redis URL)"
        else:
            why = "unreachable or failing"
        logger.warning(
            "redis tier at %s is off: %s (%s); serving misses, probing every %.1f s",
            self.where,
            why,
            self.describe(exc),
            self.breaker.reset_after_s,
        )

    def describe(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {self.scrub(str(exc))}"

    def scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def notes(self) -> dict[str, int | float | str]:
        """Figures for the store's ``stats().notes``."""
        with self._lock:
            notes: dict[str, int | float | str] = {
                "breaker": self.breaker.state,
                "last_rtt_ms": round(self.last_rtt_ms, 3),
            }
            for kind, count in sorted(self.errors_by_kind.items()):
                notes[f"errors.{kind}"] = count
            return notes
