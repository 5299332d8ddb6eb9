"""Prometheus metrics of one gateway, served on their own HTTP port for operators.

``GatewayMetrics`` owns a private ``CollectorRegistry`` (never prometheus-client's global
default one, so two gateways in one process, or two tests, never share counters). Three kinds of
series live in it:

* what the engine runs on, set once at start: ``kvgate_engine_info{device, dtype} 1`` -- a
  dashboard comparing latencies across replicas must know which ran on a GPU in bfloat16 and
  which on the CPU in float32 (their figures differ by orders of magnitude);
* request series, updated by the engine as each request ends: prompt tokens cached vs computed
  per tenant and tier, finish reasons, TTFT and total latency, queue depth;
* cache series, read from ``PrefixCache.stats()`` at scrape time by ``_CacheCollector``: bytes
  and blocks per tier, evictions by reason, promotions, demotions, load and verification
  failures, Redis errors and breaker state. Nothing is copied between scrapes, so the numbers
  are those of the cache at that moment.

NOTE: the endpoint is for operators only (RELIABILITY.md, threat 1). Series carry tenant ids,
tier names, reasons and counts -- never prompt text, API keys, namespaces or block keys -- and
the endpoint has no authentication, so it listens on loopback unless configured otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from gateway.cache.stats import CacheStats
from gateway.core.errors import DeadlineExceeded, EngineDraining, QueueFull, RequestCancelled

logger = logging.getLogger(__name__)

PREFIX = "kvgate"
COMPUTED_TIER = "none"
"""The ``tier`` label of computed (uncached) prompt tokens."""
REDIS_STORE = "redis"

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0)
"""From a warm hit on a small model (milliseconds) to a cold 8k-token prefill on CPU (minutes)."""


class GatewayMetrics:
    """Every metric of one gateway, in a registry of its own.

    Args:
        cache_stats: returns the cache's stats at scrape time (None: no cache series).
        device: where the model runs, as ``--device`` spells it resolved (``cpu``,
            ``cuda:0``); with ``dtype``, the ``kvgate_engine_info`` series (None: none).
        dtype: what it computes and the cache stores K/V in (``float32``, ``bfloat16``).
    """

    def __init__(self, *, cache_stats: Callable[[], CacheStats] | None = None,
                 device: str | None = None, dtype: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        if device is not None and dtype is not None:
            Info(f"{PREFIX}_engine", "What the engine runs on: the model's device and the "
                 "dtype of its weights and K/V.", registry=self.registry).info(
                {"device": device, "dtype": dtype})
        self._lock = threading.Lock()
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished generations, served from a "
            "cache tier (source=cache) or computed (source=computed, tier=none).",
            ("tenant", "source", "tier"), registry=self.registry)
        self._requests = Counter(
            f"{PREFIX}_requests", "Generations by how they ended (eos, stop, length, cancelled, "
            "deadline, draining, queue_full, error).", ("finish_reason",),
            registry=self.registry)
        self._ttft = Histogram(
            f"{PREFIX}_ttft_seconds", "Time from enqueue to the first generated token.",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._request_s = Histogram(
            f"{PREFIX}_request_seconds", "Time from enqueue to the end of the answer.",
            buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self._queue_depth = Gauge(
            f"{PREFIX}_queue_depth", "Requests waiting for the model.", registry=self.registry)
        self._shadow_checks = Counter(
            f"{PREFIX}_shadow_checks", "Cache hits recomputed cold while idle and compared bit "
            "for bit (shadow verification, [engine] shadow_fraction).", registry=self.registry)
        self._shadow_blocks = Counter(
            f"{PREFIX}_shadow_checked_blocks", "Served blocks compared with their cold "
            "recompute by shadow verification.", registry=self.registry)
        self._shadow_divergences = Counter(
            f"{PREFIX}_shadow_divergences", "Served blocks that differed from their cold "
            "recompute (warm != cold), by the tier that served them; each was evicted.",
            ("tier",), registry=self.registry)
        self.registry.register(_RatioCollector(self))
        if cache_stats is not None:
            self.registry.register(_CacheCollector(cache_stats))
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    # ---- hooks the engine calls ------------------------------------------------------

    def record_generation(self, *, tenant: str, prompt_tokens: int,
                          cached_tokens_by_tier: dict[str, int], finish_reason: str,
                          ttft_s: float, total_s: float) -> None:
        """One generation that produced its answer (its ``Usage`` was sent)."""
        num_cached = sum(cached_tokens_by_tier.values())
        for tier, num in cached_tokens_by_tier.items():
            self._prompt_tokens.labels(tenant, "cache", tier).inc(num)
        self._prompt_tokens.labels(tenant, "computed", COMPUTED_TIER).inc(
            max(0, prompt_tokens - num_cached))
        self._requests.labels(finish_reason).inc()
        self._ttft.observe(ttft_s)
        self._request_s.observe(total_s)
        with self._lock:
            self._num_prompt_tokens += prompt_tokens
            self._num_cached_tokens += num_cached

    def record_failure(self, exc: BaseException) -> None:
        """A generation that ended without an answer (cancelled, deadline, refused, error)."""
        self._requests.labels(failure_reason(exc)).inc()

    def set_queue_depth(self, depth: int) -> None:
        self._queue_depth.set(depth)

    def record_shadow_check(self, *, num_blocks: int, divergent_tiers: Sequence[str]) -> None:
        """One shadow verification of ``num_blocks`` served blocks (``gateway.engine.shadow``)."""
        self._shadow_checks.inc()
        self._shadow_blocks.inc(num_blocks)
        for tier in divergent_tiers:
            self._shadow_divergences.labels(tier).inc()

    def hit_ratio(self) -> float:
        """Cached / prompt tokens of every generation since start (0 before the first)."""
        with self._lock:
            if not self._num_prompt_tokens:
                return 0.0
            return self._num_cached_tokens / self._num_prompt_tokens

    # ---- the HTTP endpoint -----------------------------------------------------------

    def watch_feed(self, feed: FeedState) -> None:
        """Series of the eviction feed (the events other replicas publish), read at scrape
        time: events by outcome, whether its reader runs, seconds since it last read."""
        self.registry.register(_FeedCollector(feed))

    def start(self, host: str, port: int) -> int:
        """Serve ``/metrics`` over HTTP on ``host:port`` (0 picks a free port).

        Returns:
            The bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._server, self._thread = server, thread
        self.port = int(server.server_port)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None


_FAILURE_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (RequestCancelled, "cancelled"),
    (DeadlineExceeded, "deadline"),
    (EngineDraining, "draining"),
    (QueueFull, "queue_full"),
)


def failure_reason(exc: BaseException) -> str:
    """The ``finish_reason`` label of a generation that failed with ``exc``."""
    for kind, reason in _FAILURE_REASONS:
        if isinstance(exc, kind):
            return reason
    return "error"


class _RatioCollector(Collector):
    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            f"{PREFIX}_cache_hit_ratio",
            "Cached / prompt tokens of all generations since start.",
            value=self._metrics.hit_ratio())


class FeedState(Protocol):
    """What the metrics read of ``gateway.cache.invalidation.EvictionFeed``."""

    num_applied: int
    num_malformed: int
    num_failed: int
    last_read_at: float | None

    @property
    def is_reading(self) -> bool: ...


class _FeedCollector(Collector):
    """The eviction feed's series (``GatewayMetrics.watch_feed``)."""

    def __init__(self, feed: FeedState, clock: Callable[[], float] = time.monotonic) -> None:
        self._feed = feed
        self._clock = clock

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        feed = self._feed
        events = CounterMetricFamily(
            f"{PREFIX}_eviction_events", "Eviction events read from other replicas, by outcome "
            "(applied; malformed: unreadable, skipped; failed: applying raised, skipped).",
            labels=("outcome",))
        for outcome, count in (("applied", feed.num_applied), ("malformed", feed.num_malformed),
                               ("failed", feed.num_failed)):
            events.add_metric((outcome,), count)
        yield events
        yield GaugeMetricFamily(f"{PREFIX}_eviction_reader_up", "1 while the eviction reader "
                                "runs.", value=1.0 if feed.is_reading else 0.0)
        since = (self._clock() - feed.last_read_at if feed.last_read_at is not None
                 else float("nan"))
        yield GaugeMetricFamily(f"{PREFIX}_eviction_stream_read_age_seconds", "Seconds since "
                                "the reader last read the stream (NaN: never).", value=since)


class _CacheCollector(Collector):
    """Cache and store series, read from ``CacheStats`` at scrape time."""

    def __init__(self, cache_stats: Callable[[], CacheStats]) -> None:
        self._cache_stats = cache_stats

    def describe(self) -> list[Any]:
        return []  # NOTE: nothing to read at registration; the cache may not be started yet

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self._cache_stats()
        tier_bytes = GaugeMetricFamily(f"{PREFIX}_tier_bytes", "Bytes held per tier.",
                                       labels=("tier",))
        tier_budget = GaugeMetricFamily(f"{PREFIX}_tier_budget_bytes", "Budget per tier.",
                                        labels=("tier",))
        tier_blocks = GaugeMetricFamily(f"{PREFIX}_tier_blocks", "Blocks held per tier.",
                                        labels=("tier",))
        evictions = CounterMetricFamily(f"{PREFIX}_evictions", "Blocks evicted, by reason.",
                                        labels=("tier", "reason"))
        promotions = CounterMetricFamily(f"{PREFIX}_promotions",
                                         "Blocks copied up into this tier on a hit.",
                                         labels=("tier",))
        demotions = CounterMetricFamily(f"{PREFIX}_demotions",
                                        "Blocks moved down into the tier below this one.",
                                        labels=("tier",))
        load_failures = CounterMetricFamily(f"{PREFIX}_load_failures",
                                            "Loads from this tier that failed (recomputed).",
                                            labels=("tier",))
        for tier in stats.tiers:
            tier_bytes.add_metric((tier.name,), tier.used_bytes)
            tier_budget.add_metric((tier.name,), tier.budget_bytes)
            tier_blocks.add_metric((tier.name,), tier.num_blocks)
            for reason, num in sorted(tier.evictions.items()):
                evictions.add_metric((tier.name, reason), num)
            promotions.add_metric((tier.name,), tier.promotions)
            demotions.add_metric((tier.name,), tier.demotions)
            load_failures.add_metric((tier.name,), tier.load_failures)
        verification = CounterMetricFamily(
            f"{PREFIX}_verification_failures",
            "Blocks read from a store that failed verification (a counted miss), by reason.",
            labels=("tier", "reason"))
        families: list[CounterMetricFamily | GaugeMetricFamily] = [
            tier_bytes, tier_budget, tier_blocks, evictions, promotions, demotions,
            load_failures, verification]
        for store in stats.stores:
            for reason, num in sorted(store.verification_failures.items()):
                verification.add_metric((store.name, reason), num)
            if store.name == REDIS_STORE:
                families.append(CounterMetricFamily(
                    f"{PREFIX}_redis_errors", "Redis operations that failed.",
                    value=store.errors))
                families.append(GaugeMetricFamily(
                    f"{PREFIX}_redis_breaker_open",
                    "1 while the Redis circuit breaker is open (Redis skipped), else 0.",
                    value=1 if store.notes.get("breaker") == "open" else 0))
        yield from families
