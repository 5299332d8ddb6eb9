"""Prometheus metrics of one gateway: ``/metrics`` on the HTTP API port, and on a port of its own.

``GatewayMetrics`` owns two private ``CollectorRegistry``s (never prometheus-client's global
default one, so two gateways in one process, or two tests, never share counters): ``registry``,
everything, for the operators' own port (``[metrics]``), and ``public_registry``, the same
series without any tenant label, for ``GET /metrics`` on the API port (``[http] metrics``),
which has no authentication there, as routers and Prometheus expect. A collector without a
tenant label is registered in both; the per-tenant prompt-token counter has a tenant-free twin
of the same name in the public one. Series:

* what the engine runs on, set once at start: ``kvgate_engine_info{device, dtype} 1`` -- a
  dashboard comparing latencies across replicas must know which ran on a GPU in bfloat16 and
  which on the CPU in float32 (their figures differ by orders of magnitude);
* request series, updated by the engine as each request ends: prompt tokens cached vs computed
  per tenant and tier, finish reasons, TTFT and total latency, queue depth, and lossy answers
  (``kvgate_lossy_responses_total``: generations served quantized copies, which only a request
  with ``allow_lossy`` gets; their tokens count under the tier with its format,
  ``tier="disk:int8"``, so a query for ``tier="disk"`` counts exact copies only);
* engine step series: requests and tokens per step, queue wait (submit to admission),
  inter-token latency, completion tokens, KV bytes the running requests reserve against the
  budget;
* the process (``process_*``: CPU, resident and virtual memory, open files; read from /proc at
  most once per ``PROCESS_MAX_AGE_S``) and the interpreter (``python_info``, ``python_gc_*``);
* cache series, read from ``PrefixCache.stats()`` at scrape time by ``_CacheCollector``: bytes
  and blocks per tier, evictions by reason, promotions, demotions, load and verification
  failures, Redis errors and breaker state. Nothing is copied between scrapes, so the numbers
  are those of the cache at that moment (one ``stats()`` per scrape: the collectors that read it
  share a snapshot at most ``CACHE_STATS_MAX_AGE_S`` old);
* what routers read, under vLLM's names (``vllm:num_requests_waiting``, ``..._running``,
  ``vllm:kv_cache_usage_perc``, the prefix-cache counters, ``vllm:cache_config_info``), once the
  engine runs (``watch_router``; ``gateway.service.router_metrics``).

NOTE: the operators' port is for operators only (docs/reliability.md, threat 1). Its series carry
tenant ids, tier names, reasons and counts -- never prompt text, API keys, namespaces or block
keys -- and it has no authentication, so it listens on loopback unless configured otherwise.
The API port's ``/metrics`` carries no tenant id either (docs/security.md, "Surfaces").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.core.admin_reports import StatsReport
from gateway.core.errors import DeadlineExceeded, EngineDraining, QueueFull, RequestCancelled
from gateway.service.metrics_listener import MetricsListener
from gateway.service.router_metrics import (
    CacheConfigInfo,
    RouterCounts,
    VllmCollector,
)
from gateway.service.scrape_token import ScrapeToken

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=Collector)
T = TypeVar("T")

PREFIX = "kvgate"
COMPUTED_TIER = "none"
"""The ``tier`` label of computed (uncached) prompt tokens."""
REDIS_STORE = "redis"

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0)
"""From a warm hit on a small model (milliseconds) to a cold 8k-token prefill on CPU (minutes)."""
STEP_REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Requests in one engine step (``[engine] max_running`` is 16 by default)."""
STEP_TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Tokens one step computes (``[engine] step_tokens`` 256, ``prefill_step_tokens`` 1024 on a CPU,
8192 on a GPU)."""
PROCESS_MAX_AGE_S = 1.0
"""``process_*`` are read from /proc (three files and the fd directory) at most this often: a
router polling every 50 ms needs none of them fresher, and they change slowly."""
CACHE_STATS_MAX_AGE_S = 0.005
"""The cache's stats are read (under the cache's lock) once per scrape, not once per collector:
a snapshot this young is reused. Far below any poll interval (a router's 50 ms)."""

INTER_TOKEN_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                         0.3, 0.5, 1.0, 2.5, 5.0)
"""One decode step: about a millisecond on a GPU to a few hundred on a loaded CPU."""

_LOSSY_HELP = ("Generations answered from lossy (quantized) copies of their prompt "
               "(CacheOptions.allow_lossy), not the model's own answer; their tokens are in "
               "kvgate_prompt_tokens_total under the tier and its format (tier disk:int8)")
"""The lossy-answer counter's help text (with a tenant label on the operators' port, without on
the API port's, as the prompt-token counter)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsTotals:
    """Running totals since start, for the periodic stats line (``gateway.service.stats_log``).

    Attributes:
        num_requests: generations ended (answered or failed).
        num_prompt_tokens: prompt tokens of answered generations.
        num_completion_tokens: tokens they generated.
        cached_tokens_by_tier: of the prompt tokens, those served by each tier.
        queue_depth: requests waiting for the model now.
        kv_bytes_in_use: KV bytes the running requests hold now (their pages).
        kv_budget_bytes: the engine's KV budget (0: not known).
    """

    num_requests: int
    num_prompt_tokens: int
    num_completion_tokens: int
    cached_tokens_by_tier: dict[str, int]
    queue_depth: int
    kv_bytes_in_use: int
    kv_budget_bytes: int


class GatewayMetrics:
    """Every metric of one gateway, in a registry of its own.

    Args:
        cache_stats: returns the cache's stats at scrape time (None: no cache series until
            ``watch_cache``).
        device: where the model runs, as ``--device`` spells it resolved (``cpu``,
            ``cuda:0``); with ``dtype``, the ``kvgate_engine_info`` series (None: none until
            ``set_engine_info``).
        dtype: what it computes and the cache stores K/V in (``float32``, ``bfloat16``).
        kv_budget_bytes: the engine's KV budget (``[engine] kv_budget_bytes``; None: 0).

    Attributes:
        registry: every series (the operators' port).
        public_registry: the series without tenant labels (``/metrics`` on the API port).
    """

    def __init__(self, *, cache_stats: Callable[[], StatsReport] | None = None,
                 device: str | None = None, dtype: str | None = None,
                 kv_budget_bytes: int | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.public_registry = CollectorRegistry(auto_describe=True)
        if device is not None and dtype is not None:
            self.set_engine_info(device=device, dtype=dtype)
        self._lock = threading.Lock()
        self._num_prompt_tokens = 0
        self._num_cached_tokens = 0
        self._num_requests = 0
        self._num_completion_tokens = 0
        self._cached_by_tier: dict[str, int] = {}
        self._queue_depth_now = 0
        self._kv_bytes_now = 0
        self._kv_budget = kv_budget_bytes or 0
        self._cache_stats: Callable[[], StatsReport] | None = None
        self._prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished generations, served from a "
            "cache tier (source=cache) or computed (source=computed, tier=none).",
            ("tenant", "source", "tier"), registry=self.registry)
        self._public_prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished generations, served from a "
            "cache tier (source=cache) or computed (source=computed, tier=none); all tenants.",
            ("source", "tier"), registry=self.public_registry)
        self._lossy_responses = Counter(
            f"{PREFIX}_lossy_responses", _LOSSY_HELP + ".", ("tenant",), registry=self.registry)
        self._public_lossy_responses = Counter(
            f"{PREFIX}_lossy_responses", _LOSSY_HELP + "; all tenants.",
            registry=self.public_registry)
        self._requests = self._shared(Counter(
            f"{PREFIX}_requests", "Generations by how they ended (eos, stop, length, cancelled, "
            "deadline, draining, queue_full, error).", ("finish_reason",), registry=None))
        self._ttft = self._shared(Histogram(
            f"{PREFIX}_ttft_seconds", "Time from enqueue to the first generated token.",
            buckets=LATENCY_BUCKETS_S, registry=None))
        self._request_s = self._shared(Histogram(
            f"{PREFIX}_request_seconds", "Time from enqueue to the end of the answer.",
            buckets=LATENCY_BUCKETS_S, registry=None))
        self._queue_depth = self._shared(Gauge(
            f"{PREFIX}_queue_depth", "Requests waiting for the model.", registry=None))
        self._shadow_checks = self._shared(Counter(
            f"{PREFIX}_shadow_checks", "Cache hits recomputed cold while idle and compared bit "
            "for bit (shadow verification, [engine] shadow_fraction).", registry=None))
        self._shadow_blocks = self._shared(Counter(
            f"{PREFIX}_shadow_checked_blocks", "Served blocks compared with their cold "
            "recompute by shadow verification.", registry=None))
        self._shadow_divergences = self._shared(Counter(
            f"{PREFIX}_shadow_divergences", "Served blocks that differed from their cold "
            "recompute (warm != cold), by the tier that served them; each was evicted.",
            ("tier",), registry=None))
        self._step_requests = self._shared(Histogram(
            f"{PREFIX}_step_requests", "Requests in one engine step (the batch size).",
            buckets=STEP_REQUEST_BUCKETS, registry=None))
        self._step_tokens = self._shared(Histogram(
            f"{PREFIX}_step_tokens", "Tokens computed in one engine step (decode rows and "
            "prefill chunks).", buckets=STEP_TOKEN_BUCKETS, registry=None))
        self._queue_wait = self._shared(Histogram(
            f"{PREFIX}_queue_wait_seconds", "Time from submission to admission by the "
            "scheduler (generations and warms).", buckets=LATENCY_BUCKETS_S, registry=None))
        self._kv_in_use = self._shared(Gauge(
            f"{PREFIX}_kv_bytes_in_use", "KV bytes the running requests hold: the pages of "
            "their block tables, a cached prefix they share counted once.", registry=None))
        self._kv_tokens_in_use = self._shared(Gauge(
            f"{PREFIX}_kv_tokens_in_use", "Tokens in the pages of kvgate_kv_bytes_in_use, a "
            "shared page counted once: what a cache keeping each distinct token once would "
            "hold.", registry=None))
        self._kv_budget_gauge = self._shared(Gauge(
            f"{PREFIX}_kv_budget_bytes", "The KV bytes the running requests' own pages may "
            "reserve together ([engine] kv_budget_bytes).", registry=None))
        self._kv_budget_gauge.set(self._kv_budget)
        self._completion_tokens = self._shared(Counter(
            f"{PREFIX}_completion_tokens", "Tokens generated by finished generations.",
            registry=None))
        self._preemptions = self._shared(Counter(
            f"{PREFIX}_preemptions", "Running generations preempted for a better-priority "
            "request of their tenant (each resumed later from its cached K/V, to the same "
            "answer).", registry=None))
        self._inter_token = self._shared(Histogram(
            f"{PREFIX}_inter_token_latency_seconds", "Time between two consecutive generated "
            "tokens of one request.", buckets=INTER_TOKEN_BUCKETS_S, registry=None))
        self._shared(_RatioCollector(self))
        self._shared(_Recent(ProcessCollector(registry=None), max_age_s=PROCESS_MAX_AGE_S))
        self._shared(PlatformCollector(registry=None))
        # NOTE: GCCollector registers itself (it takes no None), in one registry of the two.
        self.public_registry.register(GCCollector(registry=self.registry))
        if cache_stats is not None:
            self.watch_cache(cache_stats)
        self._listener: MetricsListener | None = None
        self.port: int | None = None

    def _shared(self, collector: C) -> C:
        """Register ``collector`` (no tenant label) in both registries."""
        self.registry.register(collector)
        self.public_registry.register(collector)
        return collector

    def set_engine_info(self, *, device: str, dtype: str) -> None:
        """The ``kvgate_engine_info{device, dtype} 1`` series, once the model is loaded."""
        self._shared(Info(f"{PREFIX}_engine", "What the engine runs on: the model's device and "
                          "the dtype of its weights and K/V.", registry=None)).info(
            {"device": device, "dtype": dtype})

    def watch_accept_errors(self, num_failed: Callable[[], int]) -> None:
        """``kvgate_http_accept_errors_total``: the HTTP front's accepts that failed for want of
        descriptors (``gateway.service.http.accept_errors``), read at scrape time."""
        self._shared(_CountCollector(
            f"{PREFIX}_http_accept_errors", "Connections the HTTP front could not accept for "
            "want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM); logged once per "
            "burst.", num_failed))

    def watch_cache(self, cache_stats: Callable[[], StatsReport]) -> None:
        """Series of the cache's tiers and stores, read from ``cache_stats()`` at scrape time."""
        self._cache_stats = _Snapshot(cache_stats, max_age_s=CACHE_STATS_MAX_AGE_S)
        self._shared(_CacheCollector(self._cache_stats))

    def watch_router(self, *, model_name: str, num_running: Callable[[], int],
                     kv_usage: Callable[[], float], info: CacheConfigInfo) -> None:
        """vLLM's series for routers (``gateway.service.router_metrics``), once the engine runs.

        Args:
            model_name: their ``model_name`` label: the first served model name.
            num_running: the requests the engine's scheduler has admitted and not finished.
            kv_usage: the fraction of the KV page pool the running requests hold.
            info: the cache's configuration (``vllm:cache_config_info``).
        """
        def counts() -> RouterCounts:
            with self._lock:
                num_prompt, num_cached = self._num_prompt_tokens, self._num_cached_tokens
            return RouterCounts(
                num_waiting=self._queue_depth_now, num_running=num_running(),
                num_prompt_tokens=num_prompt, num_cached_tokens=num_cached,
                kv_usage=kv_usage())

        self._shared(VllmCollector(model_name=model_name, counts=counts, info=info))

    # ---- hooks the engine calls ------------------------------------------------------

    def record_generation(self, *, tenant: str, prompt_tokens: int,
                          cached_tokens_by_tier: dict[str, int], finish_reason: str,
                          ttft_s: float, total_s: float, completion_tokens: int = 0,
                          lossy: bool = False) -> None:
        """One generation that produced its answer (its ``Usage`` was sent).

        ``lossy``: its ``Usage.lossy`` (computed on quantized K/V); its lossy tiers come in
        ``cached_tokens_by_tier`` under their format (``disk:int8``), counted as any tier.
        """
        num_cached = sum(cached_tokens_by_tier.values())
        num_computed = max(0, prompt_tokens - num_cached)
        for tier, num in cached_tokens_by_tier.items():
            self._prompt_tokens.labels(tenant, "cache", tier).inc(num)
            self._public_prompt_tokens.labels("cache", tier).inc(num)
        self._prompt_tokens.labels(tenant, "computed", COMPUTED_TIER).inc(num_computed)
        self._public_prompt_tokens.labels("computed", COMPUTED_TIER).inc(num_computed)
        if lossy:
            self._lossy_responses.labels(tenant).inc()
            self._public_lossy_responses.inc()
        self._requests.labels(finish_reason).inc()
        self._ttft.observe(ttft_s)
        self._request_s.observe(total_s)
        self._completion_tokens.inc(completion_tokens)
        with self._lock:
            self._num_requests += 1
            self._num_prompt_tokens += prompt_tokens
            self._num_cached_tokens += num_cached
            self._num_completion_tokens += completion_tokens
            for tier, num in cached_tokens_by_tier.items():
                self._cached_by_tier[tier] = self._cached_by_tier.get(tier, 0) + num

    def record_failure(self, exc: BaseException) -> None:
        """A generation that ended without an answer (cancelled, deadline, refused, error)."""
        self._requests.labels(failure_reason(exc)).inc()
        with self._lock:
            self._num_requests += 1

    def set_queue_depth(self, depth: int) -> None:
        self._queue_depth.set(depth)
        self._queue_depth_now = depth

    def set_kv_in_use(self, num_bytes: int, *, num_tokens: int) -> None:
        """KV bytes the running requests hold now, and the distinct tokens in them."""
        self._kv_in_use.set(num_bytes)
        self._kv_tokens_in_use.set(num_tokens)
        self._kv_bytes_now = num_bytes

    def record_step(self, *, num_requests: int, num_tokens: int) -> None:
        """One engine step (forward) of ``num_requests`` requests computing ``num_tokens``."""
        self._step_requests.observe(num_requests)
        self._step_tokens.observe(num_tokens)

    def record_queue_wait(self, wait_s: float) -> None:
        """A request admitted ``wait_s`` after its submission."""
        self._queue_wait.observe(wait_s)

    def record_inter_token(self, gap_s: float) -> None:
        """A generated token ``gap_s`` after its request's previous one."""
        self._inter_token.observe(gap_s)

    def record_preemption(self) -> None:
        """A generation preempted for a better-priority request of its tenant."""
        self._preemptions.inc()

    def record_shadow_check(self, *, num_blocks: int, divergent_tiers: Sequence[str]) -> None:
        """One shadow verification of ``num_blocks`` served blocks
        (``gateway.engine.parity.shadow``)."""
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

    def totals(self) -> MetricsTotals:
        """The running totals since start (cheap: no registry is read)."""
        with self._lock:
            return MetricsTotals(
                num_requests=self._num_requests, num_prompt_tokens=self._num_prompt_tokens,
                num_completion_tokens=self._num_completion_tokens,
                cached_tokens_by_tier=dict(self._cached_by_tier),
                queue_depth=self._queue_depth_now, kv_bytes_in_use=self._kv_bytes_now,
                kv_budget_bytes=self._kv_budget)

    # ---- the HTTP endpoint -----------------------------------------------------------

    def watch_feed(self, feed: FeedState) -> None:
        """Series of the eviction feed (the events other replicas publish), read at scrape
        time: events by outcome, whether its reader runs, seconds since it last read."""
        self._shared(_FeedCollector(feed))

    def start(self, host: str, port: int, *, scrape_token: ScrapeToken | None = None) -> int:
        """Serve ``/metrics`` (every series) over HTTP on ``host:port`` (0 picks a free port),
        answering only ``scrape_token``'s bearer where one is given.

        Returns:
            The bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        self._listener = MetricsListener(self.registry, scrape_token=scrape_token)
        self.port = self._listener.start(host, port)
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        if self._listener is not None:
            self._listener.stop()
            self._listener = None


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


class _Snapshot(Generic[T]):
    """``read()``'s value, read again only once ``max_age_s`` have passed since the last read.

    NOTE: two threads that both find it stale both read; each gets a value no older than
    ``max_age_s`` all the same.
    """

    def __init__(self, read: Callable[[], T], *, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read = read
        self._max_age_s = max_age_s
        self._clock = clock
        self._value: tuple[float, T] | None = None

    def __call__(self) -> T:
        now = self._clock()
        value = self._value
        if value is not None and now - value[0] < self._max_age_s:
            return value[1]
        fresh = self._read()
        self._value = (now, fresh)
        return fresh


class _Recent(Collector):
    """A collector's families, collected at most once per ``max_age_s`` (``_Snapshot``)."""

    def __init__(self, collector: Collector, *, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._families = _Snapshot(lambda: list(collector.collect()), max_age_s=max_age_s,
                                   clock=clock)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        yield from self._families()


class _CountCollector(Collector):
    """One counter read from ``read()`` at scrape time."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._read())


class _RatioCollector(Collector):
    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            f"{PREFIX}_cache_hit_ratio",
            "Cached / prompt tokens of all generations since start.",
            value=self._metrics.hit_ratio())


class FeedState(Protocol):
    """What the metrics read of ``gateway.cache.operations.invalidation.EvictionFeed``."""

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
    """Cache and store series, read from the cache's ``StatsReport`` at scrape time."""

    def __init__(self, cache_stats: Callable[[], StatsReport]) -> None:
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
        recomputed = CounterMetricFamily(
            f"{PREFIX}_recomputed_instead", "Loads from this tier skipped because they were "
            "estimated slower than recomputing the blocks.", labels=("tier",))
        bandwidth = GaugeMetricFamily(
            f"{PREFIX}_tier_load_bytes_per_second", "This tier's load bandwidth as the cache "
            "estimates it (first measured before serving; absent before any load).",
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
            recomputed.add_metric((tier.name,), tier.recomputed_instead)
        verification = CounterMetricFamily(
            f"{PREFIX}_verification_failures",
            "Blocks read from a store that failed verification (a counted miss), by reason.",
            labels=("tier", "reason"))
        families: list[CounterMetricFamily | GaugeMetricFamily] = [
            tier_bytes, tier_budget, tier_blocks, evictions, promotions, demotions,
            load_failures, recomputed, verification, bandwidth]
        for store in stats.stores:
            figure = store.notes.get("load_bytes_per_s")
            if isinstance(figure, int | float):
                bandwidth.add_metric((store.name,), float(figure))
            for reason, num in sorted(store.verification_failures.items()):
                verification.add_metric((store.name, reason), num)
            if store.name == REDIS_STORE:  # not a tier of the index: its figure is the store's
                skipped = store.notes.get("recomputed_instead")
                if isinstance(skipped, int):
                    recomputed.add_metric((store.name,), skipped)
                families.append(CounterMetricFamily(
                    f"{PREFIX}_redis_errors", "Redis operations that failed.",
                    value=store.errors))
                families.append(GaugeMetricFamily(
                    f"{PREFIX}_redis_breaker_open",
                    "1 while the Redis circuit breaker is open (Redis skipped), else 0.",
                    value=1 if store.notes.get("breaker") == "open" else 0))
        yield from families
