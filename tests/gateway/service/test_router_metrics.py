"""What routers read on the API port's ``/metrics``, under vLLM's names (issue 27, item 1), and
the model id the OpenAI API serves under (``[http] served_model_name``, issue 26, item 5).

One real gateway per module, wired as ``kvgate serve`` wires it (``assembly.watch_router``): the
tiny Llama, a real cache and engine, the HTTP front on a free loopback port serving the public
registry. Requests go over HTTP with ``urllib``; ``/metrics`` is scraped unauthenticated and
parsed with prometheus-client's own parser.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cache.operations.factory import CacheConfig
from gateway.config.settings import HttpSettings, ServeConfig
from gateway.engine.models.loading import LoadedModel
from gateway.service.assembly import watch_router
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.server import HttpFront
from gateway.service.metrics import GatewayMetrics
from gateway.service.router_metrics import CacheConfigInfo
from tests.gateway.grpc_harness import (
    BLOCK,
    KEY_A,
    KEYS,
    LONG_PROMPT,
    RunningGateway,
    start_gateway,
    tiny_model,
    wait_until,
)

SERVED = ("tiny-chat", "tiny-alias")
DEVICE_BYTES = 64 << 20
HOST_BYTES = 32 << 20


class Served:
    def __init__(self, running: RunningGateway, front: HttpFront, metrics: GatewayMetrics,
                 loaded: LoadedModel) -> None:
        self.running = running
        self.front = front
        self.metrics = metrics
        self.loaded = loaded

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.front.port}"

    def chat(self, content: str, *, model: str = SERVED[0]) -> dict[str, Any]:
        body = json.dumps({"model": model, "max_tokens": 2,
                           "messages": [{"role": "user", "content": content}]}).encode()
        request = urllib.request.Request(f"{self.base}/v1/chat/completions", data=body,
                                         headers={"Authorization": f"Bearer {KEY_A}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer: dict[str, Any] = json.loads(response.read())
        return answer

    def get(self, path: str, *, key: str | None = None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(self.base + path, headers=headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()

    def scrape(self) -> dict[str, list[Any]]:
        """Samples by name (counters under their ``_total`` sample names)."""
        status, body = self.get("/metrics")
        assert status == 200
        samples: dict[str, list[Any]] = {}
        for family in text_string_to_metric_families(body.decode("utf-8")):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample)
        return samples


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    loaded = tiny_model(tmp_path_factory.mktemp("tiny-router") / "model")
    engines = EngineSlot()
    metrics = GatewayMetrics()
    cache = CacheConfig(block_tokens=BLOCK, device_bytes=DEVICE_BYTES, host_bytes=HOST_BYTES)
    running = start_gateway(loaded, engines=engines, metrics=metrics, cache_config=cache)
    config = ServeConfig(host="127.0.0.1", port=0, keys=KEYS, cache=cache,
                         http=HttpSettings(port=0, served_model_name=SERVED))
    assert running.engine is not None and running.opened is not None
    metrics.watch_cache(running.opened.cache.stats)
    watch_router(config, metrics, running.engine, running.opened.cache,
                 block_nbytes=loaded.layout.block_nbytes(BLOCK))
    front = HttpFront(config, Authenticator(KEYS), engines, metrics=metrics.public_registry)
    front.start()
    try:
        yield Served(running, front, metrics, loaded)
    finally:
        front.stop(timeout_s=5.0)
        running.stop()


def _value(samples: dict[str, list[Any]], name: str) -> float:
    [sample] = samples[name]
    assert sample.labels == {"model_name": SERVED[0], "engine": "0"}, sample.labels
    return float(sample.value)


def test_vllm_series_after_a_cold_and_a_warm_request(served: Served) -> None:
    before = served.scrape()
    assert _value(before, "vllm:prefix_cache_queries_total") == 0
    assert _value(before, "vllm:num_requests_waiting") == 0

    prompt = f"[{random.randrange(10**12)}] {LONG_PROMPT}"
    cold = served.chat(prompt)
    warm = served.chat(prompt)
    cold_cached = cold["usage"]["prompt_tokens_details"]["cached_tokens"]
    warm_cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cold_cached == 0 and warm_cached >= BLOCK

    engine = served.running.engine
    assert engine is not None
    assert wait_until(lambda: engine.num_running == 0)
    # NOTE: the API port serves a body up to 20 ms old (MetricsPage): the tiny model can answer
    # both requests within 20 ms of the first scrape, so scrape until the answers show.
    queries = cold["usage"]["prompt_tokens"] + warm["usage"]["prompt_tokens"]
    assert wait_until(
        lambda: _value(served.scrape(), "vllm:prefix_cache_queries_total") == queries)
    samples = served.scrape()
    assert _value(samples, "vllm:prefix_cache_queries_total") == queries
    assert _value(samples, "vllm:prefix_cache_hits_total") == warm_cached
    assert _value(samples, "vllm:num_requests_waiting") == 0
    assert _value(samples, "vllm:num_requests_running") == 0
    # Nothing runs: the device tier's cached pages count as free, as vLLM counts them.
    assert _value(samples, "vllm:kv_cache_usage_perc") == 0

    [info] = samples["vllm:cache_config_info"]
    block_nbytes = served.loaded.layout.block_nbytes(BLOCK)
    assert info.value == 1
    assert info.labels == {
        "block_size": str(BLOCK), "cache_dtype": engine.dtype, "enable_prefix_caching": "True",
        "engine": "0", "num_gpu_blocks": str(DEVICE_BYTES // block_nbytes),
        "num_cpu_blocks": str(HOST_BYTES // block_nbytes)}
    assert samples["process_resident_memory_bytes"][0].value > 0
    assert all("tenant" not in sample.labels
               for series in samples.values() for sample in series)


def test_num_running_counts_a_request_the_engine_is_decoding(served: Served) -> None:
    # The tiny random model samples its end token early for about one prompt in four (37 to
    # 208 tokens, in 0.1-0.5 s, where the others run the 1,500 asked for): a generation that
    # ends before a scrape shows it running is tried again with another prompt.
    seen = None
    for _ in range(8):
        seen = _scrape_while_decoding(served)
        if seen is not None:
            break
    assert seen is not None, "no generation was seen running in 8 tries"
    assert 0 < _value(seen, "vllm:kv_cache_usage_perc") < 1  # its pages, in use


def test_the_tokens_in_use_fill_every_page_in_use_but_the_last(served: Served) -> None:
    """One generation runs alone: its pages are full but its last (kvgate_kv_tokens_in_use is
    the floor that kvgate_kv_bytes_in_use pays whole pages over)."""
    seen = None
    for _ in range(8):  # see the test above: a generation may end before it is seen
        seen = _scrape_while_decoding(served)
        if seen is not None:
            break
    assert seen is not None, "no generation was seen running in 8 tries"
    [held] = seen["kvgate_kv_bytes_in_use"]
    [tokens] = seen["kvgate_kv_tokens_in_use"]
    pages = held.value / served.loaded.layout.block_nbytes(BLOCK)
    assert pages >= 1 and pages == int(pages)
    assert (pages - 1) * BLOCK < tokens.value <= pages * BLOCK


def _scrape_while_decoding(served: Served) -> dict[str, list[Any]] | None:
    """One scrape that shows a long generation running (its engine decoding), or None if it
    ended first."""
    engine = served.running.engine
    assert engine is not None and wait_until(lambda: engine.num_running == 0)
    decoded = engine.counters.num_decode_tokens
    seen: dict[str, list[Any]] | None = None

    def running_or_ended() -> bool:
        nonlocal seen
        samples = served.scrape()
        if _value(samples, "vllm:num_requests_running") == 1:
            seen = samples
            return True
        return engine.num_running == 0

    with served.running.client(KEY_A) as client:
        stream = client.generate(f"[{random.randrange(10**12)}] {LONG_PROMPT}",
                                 max_tokens=1500)
        next(stream)
        assert wait_until(lambda: engine.counters.num_decode_tokens > decoded
                          or engine.num_running == 0)
        # a body up to 20 ms old may be served first (MetricsPage): scrape until it shows
        wait_until(running_or_ended, timeout_s=5.0)
        stream.close()
    return seen


def test_the_served_model_name_is_listed_reported_and_accepted_with_its_aliases(
        served: Served) -> None:
    status, body = served.get("/v1/models", key=KEY_A)
    assert status == 200
    assert [model["id"] for model in json.loads(body)["data"]] == [SERVED[0]]
    answer = served.chat("hello", model=SERVED[1])  # an alias is accepted ...
    assert answer["model"] == SERVED[0]  # ... and the first name reported, as vLLM does
    assert json.loads(served.get("/health")[1])["model"] == SERVED[0]
    with pytest.raises(urllib.error.HTTPError) as excinfo:  # the --model value is not
        served.chat("hello", model="model")
    assert excinfo.value.code == 404
    assert SERVED[0] in json.loads(excinfo.value.read())["error"]["message"]


def test_cache_config_info_counts_whole_blocks_of_each_tier_budget() -> None:
    from gateway.core.admin_reports import StatsReport, TierReport

    def tier(name: str, budget: int, used: int) -> TierReport:
        return TierReport(name=name, num_blocks=0, used_bytes=used, budget_bytes=budget, hits=0,
                          inserts=0, refused=0, promotions=0, demotions=0, load_failures=0,
                          recomputed_instead=0, evictions={})

    stats = StatsReport(num_blocks=0, num_namespaces=0, num_token_mismatches=0,
                        num_remote_hits=0, tiers=(tier("device", 1000, 250), tier("disk", 10, 0)))
    info = CacheConfigInfo.of(stats, block_tokens=64, block_nbytes=300, dtype="bfloat16")
    assert (info.num_gpu_blocks, info.num_cpu_blocks) == (3, 0)
