"""A lossy answer end to end over gRPC: a real gateway whose disk tier keeps int8 copies, a
client that allows them, a Usage that says so, and the operators' counter.

The device tier (there is no host tier) is evicted between the requests: exact blocks then have
no exact tier below (the disk is lossy), so only the int8 copies the first request wrote
through are left (docs/design.md, "Lossy tiers").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cache.operations.factory import CacheConfig
from gateway.engine.models.loading import LoadedModel
from gateway.service.metrics import GatewayMetrics
from tests.gateway.grpc_harness import BLOCK, KEY_A, LONG_PROMPT, RunningGateway, start_gateway
from tests.gateway.grpc_harness import tiny_model as load_tiny
from tests.gateway.service.test_metrics import parse, scrape, value


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def gateway(loaded: LoadedModel, tmp_path: Path) -> Iterator[tuple[RunningGateway,
                                                                   GatewayMetrics]]:
    metrics = GatewayMetrics()
    metrics.start("127.0.0.1", 0)
    running = start_gateway(loaded, metrics=metrics, cache_config=CacheConfig(
        block_tokens=BLOCK, device_bytes=64 << 20, host_bytes=0, disk_bytes=64 << 20,
        disk_path=tmp_path / "disk", quantize={"disk": "int8"}, skip_slow_tiers=False))
    try:
        yield running, metrics
    finally:
        running.stop()
        metrics.stop()


def drop_exact_copies(running: RunningGateway) -> None:
    assert running.opened is not None
    running.opened.cache.evict("device", 1 << 40)
    running.opened.hierarchy.flush(timeout_s=30.0)


def test_a_client_that_allows_lossy_copies_is_told_its_answer_is_lossy(
        gateway: tuple[RunningGateway, GatewayMetrics]) -> None:
    running, metrics = gateway
    client = running.client(KEY_A)
    client.generate_text(LONG_PROMPT, max_tokens=4)
    drop_exact_copies(running)
    assert client.lookup(LONG_PROMPT).cached_tokens == 0
    found = client.lookup(LONG_PROMPT, allow_lossy=True)
    assert found.lossy is True and set(found.cached_tokens_by_tier) == {"disk:int8"}
    _, usage = client.generate_text(LONG_PROMPT, max_tokens=4, allow_lossy=True)
    assert usage.lossy is True
    assert usage.cached_tokens_by_tier == found.cached_tokens_by_tier
    assert set(usage.cached_tokens_by_tier) == {"disk:int8"}
    assert usage.cached_tokens == usage.cached_tokens_by_tier["disk:int8"] > 0
    assert metrics.port is not None
    samples = parse(scrape(metrics.port))
    assert value(samples, "kvgate_lossy_responses_total", tenant="tenant-a") == 1.0


def test_a_client_that_does_not_allow_them_gets_an_exact_answer(
        gateway: tuple[RunningGateway, GatewayMetrics]) -> None:
    running, _ = gateway
    client = running.client(KEY_A)
    cold, _ = client.generate_text(LONG_PROMPT, max_tokens=4, no_cache=True)
    client.generate_text(LONG_PROMPT, max_tokens=4)
    drop_exact_copies(running)
    text, usage = client.generate_text(LONG_PROMPT, max_tokens=4)
    assert usage.lossy is False and usage.cached_tokens == 0
    assert text == cold
