"""The API port's ``/metrics`` renders at most once per 20 ms for all its scrapers, and the slow
or locked parts of a scrape (``process_*`` from /proc, the cache's stats) are read once however
many collectors need them (issue 26, item 3). Fake clocks, real registries."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from gateway.core.admin_reports import StatsReport, StoreReport, TierReport
from gateway.service.http.metrics_page import DEFAULT_MAX_AGE_S, MetricsPage
from gateway.service.metrics import CACHE_STATS_MAX_AGE_S, GatewayMetrics
from gateway.service.router_metrics import CacheConfigInfo


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_scrape_within_the_max_age_gets_the_same_body_and_a_later_one_a_fresh_render() -> None:
    registry = CollectorRegistry()
    counter = Counter("things", "Things.", registry=registry)
    clock = FakeClock()
    page = MetricsPage(registry, clock=clock)
    first, content_type = page.render("")
    assert b"things_total 0.0" in first and content_type.startswith("text/plain")
    counter.inc()
    clock.now += DEFAULT_MAX_AGE_S / 2
    assert page.render("")[0] == first  # a second scraper in the same 20 ms
    clock.now += DEFAULT_MAX_AGE_S
    assert b"things_total 1.0" in page.render("")[0]
    assert page.num_renders == 2


def test_each_format_is_rendered_and_kept_on_its_own() -> None:
    registry = CollectorRegistry()
    Counter("things", "Things.", registry=registry)
    page = MetricsPage(registry, clock=FakeClock())
    text, _ = page.render("")
    body, content_type = page.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n") and body != text
    assert page.num_renders == 2


def test_the_max_age_stays_under_a_routers_poll_interval() -> None:
    assert DEFAULT_MAX_AGE_S < 0.05  # the endpoint picker polls every 50 ms
    assert CACHE_STATS_MAX_AGE_S < DEFAULT_MAX_AGE_S


def test_one_scrape_reads_the_cache_stats_once_for_every_collector() -> None:
    reads = []

    def stats() -> StatsReport:
        reads.append(1)
        tier = TierReport(name="device", num_blocks=1, used_bytes=512, budget_bytes=1024,
                          hits=0, inserts=1, refused=0, promotions=0, demotions=0,
                          load_failures=0, recomputed_instead=0, evictions={})
        return StatsReport(num_blocks=1, num_namespaces=1, num_token_mismatches=0,
                           num_remote_hits=0, tiers=(tier,))

    metrics = GatewayMetrics()
    metrics.watch_cache(stats)
    metrics.watch_router(model_name="m", num_running=lambda: 0, kv_usage=lambda: 0.5,
                         info=CacheConfigInfo(block_size=16, num_gpu_blocks=2,
                                              num_cpu_blocks=0, cache_dtype="float32"))
    body = MetricsPage(metrics.public_registry, max_age_s=0).render("")[0]
    assert b"kvgate_tier_bytes" in body and b"vllm:kv_cache_usage_perc" in body
    assert b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5' in body
    assert len(reads) == 1


def test_a_tiers_load_bandwidth_and_the_loads_it_skipped_are_series() -> None:
    disk = TierReport(name="disk", num_blocks=0, used_bytes=0, budget_bytes=1024, hits=0,
                      inserts=0, refused=0, promotions=0, demotions=0, load_failures=0,
                      recomputed_instead=3, evictions={})
    stores = (StoreReport(name="disk", notes={"load_bytes_per_s": 1_500_000_000}),
              StoreReport(name="device"),
              StoreReport(name="redis", notes={"recomputed_instead": 2}))
    metrics = GatewayMetrics()
    metrics.watch_cache(lambda: StatsReport(num_blocks=0, num_namespaces=0,
                                            num_token_mismatches=0, num_remote_hits=0,
                                            tiers=(disk,), stores=stores))
    body = MetricsPage(metrics.public_registry, max_age_s=0).render("")[0]
    assert b'kvgate_recomputed_instead_total{tier="disk"} 3.0' in body
    assert b'kvgate_recomputed_instead_total{tier="redis"} 2.0' in body
    assert b'kvgate_tier_load_bytes_per_second{tier="disk"} 1.5e+09' in body
    assert b'kvgate_tier_load_bytes_per_second{tier="device"}' not in body  # never measured
