"""The Prometheus endpoint: a real gateway, real requests, scraped over HTTP and parsed.

In process (the ``test_grpc_harness`` gateway, with a ``GatewayMetrics`` handed to its engine)
for exact counter values after known requests; and ``kvgate serve`` with ``[metrics]`` enabled,
to see the endpoint come up from the configuration and go away on SIGTERM.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.factory import CacheConfig, open_cache
from gateway.core.errors import DeadlineExceeded, EngineDraining, QueueFull, RequestCancelled
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import LoadedModel
from gateway.service.http.text_exposition import TextExposition
from gateway.service.metrics import GatewayMetrics, failure_reason
from tests.gateway.cli.test_grpc_cli import CONFIG, GatewayProcess
from tests.gateway.grpc_harness import (
    ALL_KEYS,
    BLOCK,
    KEY_A,
    KEY_B,
    LONG_PROMPT,
    SECRET,
    RunningGateway,
    start_gateway,
    tiny_model,
    wait_until,
)
from tests.tiny_llama import save_tiny_llama

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        body: bytes = response.read()
    return body.decode("utf-8")


def parse(text: str) -> Samples:
    """Every sample as {(name, sorted labels): value}."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def gateway(loaded: LoadedModel) -> Iterator[tuple[RunningGateway, GatewayMetrics]]:
    running = start_gateway(None)
    running.opened = open_cache(
        CacheConfig(block_tokens=BLOCK, device_bytes=64 << 20, host_bytes=64 << 20),
        layout=loaded.layout, deployment_secret=SECRET,
    )
    metrics = GatewayMetrics(cache_stats=running.opened.cache.stats)
    metrics.start("127.0.0.1", 0)
    running.engine = Engine(loaded=loaded, cache=running.opened.cache, pool=running.opened.pool,
                            config=EngineConfig(block_tokens=BLOCK), deployment_secret=SECRET,
                            metrics=metrics)
    running.engine.start()
    admin = CacheAdmin(running.opened.cache, keys=running.engine)
    running.server.attach(running.engine, admin)
    try:
        yield running, metrics
    finally:
        running.stop()
        metrics.stop()


def test_counters_after_known_requests(
    gateway: tuple[RunningGateway, GatewayMetrics],
) -> None:
    running, metrics = gateway
    assert metrics.port is not None
    before = parse(scrape(metrics.port))
    assert value(before, "kvgate_cache_hit_ratio") == 0.0
    assert value(before, "kvgate_queue_depth") == 0.0
    assert value(before, "kvgate_ttft_seconds_count") == 0.0

    _, cold = running.client(KEY_A).generate_text(LONG_PROMPT, max_tokens=4)
    _, warm = running.client(KEY_A).generate_text(LONG_PROMPT, max_tokens=4)
    _, other = running.client(KEY_B).generate_text(LONG_PROMPT, max_tokens=4)
    assert wait_until(lambda: running.total_refcount() == 0)
    prompt = cold.prompt_tokens
    assert cold.cached_tokens == 0 and other.cached_tokens == 0  # tenants do not share
    assert warm.cached_tokens_by_tier == {"device": warm.cached_tokens}
    assert warm.cached_tokens >= (prompt - 1) // BLOCK * BLOCK > 0

    text = scrape(metrics.port)
    samples = parse(text)
    name = "kvgate_prompt_tokens_total"
    assert value(samples, name, tenant="tenant-a", source="computed", tier="none") == (
        2 * prompt - warm.cached_tokens)
    assert value(samples, name, tenant="tenant-a", source="cache", tier="device") == (
        warm.cached_tokens)
    assert value(samples, name, tenant="tenant-b", source="computed", tier="none") == prompt
    assert value(samples, name, tenant="tenant-b", source="cache", tier="device") is None
    assert value(samples, "kvgate_requests_total", finish_reason="length") == 3
    assert value(samples, "kvgate_cache_hit_ratio") == pytest.approx(
        warm.cached_tokens / (3 * prompt))
    assert value(samples, "kvgate_ttft_seconds_count") == 3
    assert value(samples, "kvgate_request_seconds_count") == 3
    assert value(samples, "kvgate_request_seconds_sum") == pytest.approx(
        (cold.total_ms + warm.total_ms + other.total_ms) / 1e3)
    assert value(samples, "kvgate_queue_depth") == 0

    assert running.opened is not None
    stats = running.opened.cache.stats()
    for tier in stats.tiers:
        assert value(samples, "kvgate_tier_blocks", tier=tier.name) == tier.num_blocks
        assert value(samples, "kvgate_tier_bytes", tier=tier.name) == tier.used_bytes
        assert value(samples, "kvgate_promotions_total", tier=tier.name) == tier.promotions
        assert value(samples, "kvgate_demotions_total", tier=tier.name) == tier.demotions
    device = next(t for t in stats.tiers if t.name == "device")
    assert device.num_blocks > 0 and device.used_bytes > 0
    # no Redis configured: no Redis series
    assert not any(n.startswith("kvgate_redis") for n, _ in samples)

    # operator-only, but still: no prompt text, no key, no namespace or block key
    for secret in (*ALL_KEYS, "careful assistant", "preamble"):
        assert secret not in text
    assert running.engine is not None
    admin = CacheAdmin(running.opened.cache, keys=running.engine)
    listed = admin.list_prefixes(tenant=None, limit=100)
    assert listed
    for summary in listed:
        assert summary.key_hex not in text


def test_failure_reasons() -> None:
    assert failure_reason(RequestCancelled("x")) == "cancelled"
    assert failure_reason(DeadlineExceeded("x")) == "deadline"
    assert failure_reason(EngineDraining("x")) == "draining"
    assert failure_reason(QueueFull("x")) == "queue_full"
    assert failure_reason(RuntimeError("bug")) == "error"


def test_two_gateways_do_not_share_counters() -> None:
    first, second = GatewayMetrics(), GatewayMetrics()
    first.record_generation(tenant="t", prompt_tokens=32, cached_tokens_by_tier={"host": 16},
                            finish_reason="eos", ttft_s=0.1, total_s=0.2)
    first.record_failure(QueueFull("full"))
    assert first.registry.get_sample_value("kvgate_requests_total",
                                           {"finish_reason": "eos"}) == 1
    assert first.registry.get_sample_value("kvgate_requests_total",
                                           {"finish_reason": "queue_full"}) == 1
    assert first.registry.get_sample_value("kvgate_cache_hit_ratio") == 0.5
    assert second.registry.get_sample_value("kvgate_requests_total",
                                            {"finish_reason": "eos"}) is None


def test_preemptions_are_counted_on_both_ports_with_a_help_text() -> None:
    metrics = GatewayMetrics()
    metrics.record_preemption()
    metrics.record_preemption()
    for registry in (metrics.registry, metrics.public_registry):
        assert registry.get_sample_value("kvgate_preemptions_total") == 2
        text = generate_latest(registry).decode("utf-8")
        assert "# HELP kvgate_preemptions_total Running generations preempted" in text


def _record(metrics: GatewayMetrics, tenant: str, by_tier: dict[str, int], *,
            lossy: bool = False) -> None:
    metrics.record_generation(tenant=tenant, prompt_tokens=2100, cached_tokens_by_tier=by_tier,
                              finish_reason="length", ttft_s=0.1, total_s=0.2, lossy=lossy)


def test_lossy_answers_are_counted_by_tenant_and_in_all_on_the_api_port() -> None:
    metrics = GatewayMetrics()
    name = "kvgate_lossy_responses_total"
    assert metrics.public_registry.get_sample_value(name) == 0  # a series to alert on at once
    _record(metrics, "t", {"device": 128})
    _record(metrics, "t", {"device": 128, "disk:int8": 1920}, lossy=True)
    _record(metrics, "u", {"redis:fp8": 2048}, lossy=True)
    assert metrics.registry.get_sample_value(name, {"tenant": "t"}) == 1
    assert metrics.registry.get_sample_value(name, {"tenant": "u"}) == 1
    assert metrics.public_registry.get_sample_value(name) == 2
    public = generate_latest(metrics.public_registry).decode("utf-8")
    assert "# HELP kvgate_lossy_responses_total Generations answered from lossy" in public
    assert "tenant=" not in public
    assert metrics.registry.get_sample_value("kvgate_requests_total",
                                             {"finish_reason": "length"}) == 3


def test_a_lossy_tier_named_with_its_format_is_a_label_value_both_renderers_write_alike(
) -> None:
    metrics = GatewayMetrics()
    _record(metrics, "t", {"device": 128, "disk:int8": 1920}, lossy=True)
    _record(metrics, "t", {"redis:fp8": 64}, lossy=True)
    ours = TextExposition(metrics.public_registry).render().decode("utf-8")
    theirs = generate_latest(metrics.public_registry).decode("utf-8")

    def tokens_lines(text: str) -> list[str]:
        return [line for line in text.splitlines()
                if line.startswith(("kvgate_prompt_tokens_total", "kvgate_lossy_responses"))]

    assert tokens_lines(ours) == tokens_lines(theirs)
    assert 'kvgate_prompt_tokens_total{source="cache",tier="disk:int8"} 1920.0' in ours
    samples = parse(ours)
    assert value(samples, "kvgate_prompt_tokens_total", source="cache", tier="disk:int8") == 1920
    assert value(samples, "kvgate_prompt_tokens_total", source="cache", tier="redis:fp8") == 64
    assert value(samples, "kvgate_prompt_tokens_total", source="cache", tier="device") == 128
    assert value(samples, "kvgate_lossy_responses_total") == 2
    assert metrics.totals().cached_tokens_by_tier == {"device": 128, "disk:int8": 1920,
                                                      "redis:fp8": 64}


def test_the_engine_info_names_its_device_and_dtype() -> None:
    metrics = GatewayMetrics(device="cuda:0", dtype="bfloat16")
    assert metrics.registry.get_sample_value(
        "kvgate_engine_info", {"device": "cuda:0", "dtype": "bfloat16"}) == 1
    samples = parse(generate_latest(metrics.registry).decode("utf-8"))
    assert [labels for name, labels in samples if name == "kvgate_engine_info"] == [
        (("device", "cuda:0"), ("dtype", "bfloat16"))]


def test_without_a_device_there_is_no_engine_info() -> None:
    samples = parse(generate_latest(GatewayMetrics().registry).decode("utf-8"))
    assert not any(name == "kvgate_engine_info" for name, _ in samples)


_METRICS_LINE = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")
_START_LINE = re.compile(r"model \S+ on (\S+) in (\w+), tiers")


def test_kvgate_serve_serves_metrics_from_its_config_and_stops_on_sigterm(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
) -> None:
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("tiny-serve") / "model")
    process = GatewayProcess(tmp_path, model_dir)
    process.config.write_text(CONFIG + '\n[metrics]\nenabled = true\nhost = "127.0.0.1"\n'
                              "port = 0\n", encoding="utf-8")
    try:
        process.start()
        match = _METRICS_LINE.search(process.stderr)
        assert match, process.stderr
        port = int(match.group(1))
        result = process.generate("--max-tokens", "3", "--raw", LONG_PROMPT)
        assert result.returncode == 0, result.stderr
        text = scrape(port)
        samples = parse(text)
        assert value(samples, "kvgate_requests_total", finish_reason="length") == 1
        computed = value(samples, "kvgate_prompt_tokens_total", tenant="default",
                         source="computed", tier="none")
        assert computed is not None and computed > 0
        assert value(samples, "kvgate_tier_blocks", tier="disk") is not None
        started = _START_LINE.search(process.stderr)
        assert started, process.stderr
        assert value(samples, "kvgate_engine_info", device=started.group(1),
                      dtype=started.group(2)) == 1  # what the start line says it runs on
        assert "careful assistant" not in text
        code, _ = process.sigterm()
        assert code == 0
        with pytest.raises(urllib.error.URLError):
            scrape(port)
    finally:
        process.kill()


def test_the_eviction_feed_series_say_what_its_reader_did(redis_server) -> None:
    from gateway.cache.operations.invalidation import EventBounds, EvictionEvent, EvictionFeed
    from tiers.redis_events import RedisEventLog

    applied: list[EvictionEvent] = []
    bounds = EventBounds(max_prefix_chars=1000, max_tenant_chars=128)
    feed = EvictionFeed(RedisEventLog(redis_server.url, name="kvgate:evictions", block_s=0.2),
                        applied.append, origin="b", bounds=bounds)
    metrics = GatewayMetrics()
    metrics.watch_feed(feed)

    def series() -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        return {f"{s.name}{s.labels.get('outcome', '')}": s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    before = series()
    assert before["kvgate_eviction_reader_up"] == 0.0
    assert before["kvgate_eviction_stream_read_age_seconds"] != \
        before["kvgate_eviction_stream_read_age_seconds"]  # NaN: never read
    feed.start()
    try:
        assert feed.settled.wait(5)
        redis_server.client().xadd("kvgate:evictions", {"kind": "evict", "key_hex": "zz"})
        EvictionFeed(RedisEventLog(redis_server.url, name="kvgate:evictions"), print,
                     origin="a", bounds=bounds).publish(EvictionEvent(tenant="alice"))
        deadline = time.monotonic() + 5
        while not applied and time.monotonic() < deadline:
            time.sleep(0.02)
        after = series()
        assert after["kvgate_eviction_reader_up"] == 1.0
        assert after["kvgate_eviction_events_totalapplied"] == 1.0
        assert after["kvgate_eviction_events_totalmalformed"] == 1.0
        assert 0 <= after["kvgate_eviction_stream_read_age_seconds"] < 5
    finally:
        feed.stop()
