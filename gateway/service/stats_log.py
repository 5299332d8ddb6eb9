"""The periodic stats line, on the ``kvgate.stats`` logger: what the gateway did lately.

Every ``[logging] stats_interval_s`` (10 s by default), if any generation ended in the interval
or requests are waiting or running, one line of rates over the interval and the state now::

    interval_s=10 req_per_s=3.2 prompt_tok_per_s=410.5 completion_tok_per_s=51.2
    hit_ratio=0.62 hit_ratio_device=0.5 hit_ratio_host=0.12 queue=0 kv_in_use_bytes=4194304
    kv_budget_bytes=2147483648 kv_in_use_ratio=0.002

(``json = true``: one JSON object, the tier ratios nested under ``hit_ratio_by_tier``). The
numbers come from ``GatewayMetrics.totals()``, the running totals the engine's hooks keep, so a
line costs a few additions; the composition root calls ``tick()`` from the loop it already
runs every quarter second, so no thread of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from gateway.service.access_log import format_fields
from gateway.service.metrics import MetricsTotals

STATS_LOGGER = "kvgate.stats"


class StatsLine:
    """Logs one stats line per interval in which something happened.

    Args:
        totals: the running totals now (``GatewayMetrics.totals``).
        interval_s: seconds between lines (> 0).
        is_json: one JSON object per line instead of ``key=value`` pairs.
        clock: monotonic seconds (injected for tests).
        logger: where lines go (the ``kvgate.stats`` logger by default).
    """

    def __init__(self, totals: Callable[[], MetricsTotals], *, interval_s: float,
                 is_json: bool = False, clock: Callable[[], float] = time.monotonic,
                 logger: logging.Logger | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval_s!r}")
        self._totals = totals
        self._interval_s = interval_s
        self._is_json = is_json
        self._clock = clock
        self._logger = logger if logger is not None else logging.getLogger(STATS_LOGGER)
        self._last = totals()
        self._last_at = clock()

    def tick(self) -> str | None:
        """Log a line if an interval has passed and something happened; returns it (or None)."""
        now = self._clock()
        elapsed = now - self._last_at
        if elapsed < self._interval_s:
            return None
        current = self._totals()
        previous, self._last, self._last_at = self._last, current, now
        if (current.num_requests == previous.num_requests and not current.queue_depth
                and not current.kv_bytes_in_use):
            return None
        line = format_fields(stats_fields(previous, current, elapsed), is_json=self._is_json)
        self._logger.info("%s", line)
        return line


def stats_fields(previous: MetricsTotals, current: MetricsTotals,
                 elapsed_s: float) -> dict[str, object]:
    """The fields of one line: rates between ``previous`` and ``current``, state of ``current``."""
    prompt = current.num_prompt_tokens - previous.num_prompt_tokens
    by_tier = {
        tier: round((num - previous.cached_tokens_by_tier.get(tier, 0)) / prompt, 3)
        for tier, num in sorted(current.cached_tokens_by_tier.items())
    } if prompt else {}
    budget = current.kv_budget_bytes
    return {
        "interval_s": round(elapsed_s, 1),
        "req_per_s": round((current.num_requests - previous.num_requests) / elapsed_s, 2),
        "prompt_tok_per_s": round(prompt / elapsed_s, 1),
        "completion_tok_per_s": round(
            (current.num_completion_tokens - previous.num_completion_tokens) / elapsed_s, 1),
        "hit_ratio": round(sum(by_tier.values()), 3),
        "hit_ratio_by_tier": by_tier,
        "queue": current.queue_depth,
        "kv_in_use_bytes": current.kv_bytes_in_use,
        "kv_budget_bytes": budget,
        "kv_in_use_ratio": round(current.kv_bytes_in_use / budget, 3) if budget else 0.0,
    }
