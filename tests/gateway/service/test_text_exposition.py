"""The API port's plain text ``/metrics`` is exactly what ``prometheus_client.generate_latest``
writes for the same registry: the gateway's own, populated, and any registry of counters,
gauges, histograms, infos, enums and custom families with awkward names, label values and
values (hypothesis, against the library as the reference). Real registries throughout."""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import (
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    Metric,
    StateSetMetricFamily,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector

from gateway.core.admin_reports import StatsReport, StoreReport, TierReport
from gateway.service.http.text_exposition import TextExposition
from gateway.service.metrics import GatewayMetrics
from gateway.service.router_metrics import CacheConfigInfo

LABEL_VALUES = st.text(alphabet=st.sampled_from(list('ab\\\n"é_ 1東🚀')), max_size=6)
VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**20, 10**20))


def test_the_gateways_public_registry_renders_as_the_library_renders_it() -> None:
    metrics = GatewayMetrics(device="cpu", dtype="float32", kv_budget_bytes=1 << 30)
    tier = TierReport(name="device", num_blocks=3, used_bytes=4096, budget_bytes=1 << 20,
                      hits=2, inserts=3, refused=0, promotions=1, demotions=0,
                      load_failures=0, recomputed_instead=0, evictions={"lru": 4})
    store = StoreReport(name="redis", errors=2, verification_failures={"mac": 1},
                        notes={"breaker": "open"})
    metrics.watch_cache(lambda: StatsReport(num_blocks=3, num_namespaces=1,
                                            num_token_mismatches=0, num_remote_hits=0,
                                            tiers=(tier,), stores=(store,)))
    metrics.watch_router(model_name="m", num_running=lambda: 2, kv_usage=lambda: 0.25,
                         info=CacheConfigInfo(block_size=64, num_gpu_blocks=10,
                                              num_cpu_blocks=0, cache_dtype="float32"))
    for i in range(50):
        metrics.record_generation(tenant=f"t{i % 3}", prompt_tokens=100 + i,
                                  cached_tokens_by_tier={"device": 64}, finish_reason="length",
                                  ttft_s=0.01 * i, total_s=0.1 * i, completion_tokens=8)
        metrics.record_step(num_requests=1 + i % 4, num_tokens=1 + 7 * i)
        metrics.record_inter_token(0.002 * i)
        metrics.record_queue_wait(0.001 * i)
    renderer = TextExposition(metrics.public_registry)
    ours, theirs = _rendered_at_one_moment(renderer, metrics.public_registry)
    assert ours == theirs
    metrics.record_step(num_requests=3, num_tokens=9)  # remembered series, new values
    ours, theirs = _rendered_at_one_moment(renderer, metrics.public_registry)
    assert ours == theirs


def _rendered_at_one_moment(renderer: TextExposition,
                            registry: CollectorRegistry) -> tuple[bytes, bytes]:
    """Ours and the library's rendering of the same values. The gateway's registry holds series
    that move by themselves: ``python_gc_*`` (a collection that either rendering triggers) and
    ``process_*`` (re-read from /proc once a second: a pair may straddle a re-read on a busy
    machine). So the collector is paused, and a pair that differs is taken again, twice at most
    (a difference of ours renders the same every time)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            ours, theirs = renderer.render(), generate_latest(registry)
            if ours == theirs:
                break
    finally:
        if was_enabled:
            gc.enable()
    return ours, theirs


def test_a_remembered_series_shows_its_new_value() -> None:
    registry = CollectorRegistry()
    gauge = Gauge("queue", "Queued.", ["lane"], registry=registry)
    renderer = TextExposition(registry)
    gauge.labels("chat").set(1)
    assert b'queue{lane="chat"} 1.0\n' in renderer.render()
    gauge.labels("chat").set(7)
    assert b'queue{lane="chat"} 7.0\n' in renderer.render()


class _Families(Collector):
    """Families built by hand: the types the library's own metrics never produce."""

    def __init__(self, value: float, label: str, timestamp: float | None) -> None:
        self._value, self._label, self._timestamp = value, label, timestamp

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily("custom_gauge", "A gauge\\with\nodd help.", labels=["k"])
        gauge.add_metric([self._label], self._value, timestamp=self._timestamp)
        yield gauge
        yield GaugeHistogramMetricFamily("custom_gh", "A gauge histogram.",
                                         buckets=[("1.0", 2.0), ("+Inf", 3.0)], gsum_value=4.0)
        yield StateSetMetricFamily("custom_state", "A state set.",
                                   value={"on": True, "off": False})
        untyped = UnknownMetricFamily("custom_unknown", "Unknown.", labels=["k"])
        untyped.add_metric([self._label], self._value)
        yield untyped


@settings(max_examples=60, deadline=None)
@given(labels=st.lists(LABEL_VALUES, min_size=1, max_size=4, unique=True), value=VALUES,
       observed=st.lists(st.floats(-1e6, 1e6), max_size=8),
       timestamp=st.one_of(st.none(), st.floats(0, 2e9)))
def test_any_registry_renders_as_the_library_renders_it(labels: list[str], value: float,
                                                        observed: list[float],
                                                        timestamp: float | None) -> None:
    registry = CollectorRegistry()
    counter = Counter("requests", "Requests, by label.", ["who", "what"], registry=registry)
    gauge = Gauge("level", "A level.", ["who"], registry=registry)
    histogram = Histogram("latency_seconds", "Latency.", ["who"], registry=registry,
                          buckets=(0.001, 0.5, 1e5, math.inf))
    Info("build", "Build.", registry=registry).info({"version": labels[0], "sha": "x\\y"})
    Enum("state", "State.", states=["a", "b"], registry=registry).state("b")
    Gauge("vllm:num_requests_running", "A router's name.", registry=registry).set(value)
    for i, label in enumerate(labels):
        counter.labels(label, str(i)).inc(abs(value) if math.isfinite(value) else 1)
        gauge.labels(label).set(value)
        for sample in observed:
            histogram.labels(label).observe(sample)
    registry.register(_Families(float(value), labels[-1], timestamp))
    renderer = TextExposition(registry)
    assert renderer.render() == generate_latest(registry)
    assert renderer.render() == generate_latest(registry)  # from what it remembered
