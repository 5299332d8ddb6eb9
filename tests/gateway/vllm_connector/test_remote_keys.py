"""Replicas share blocks through Redis: the scheduler counts what another replica stored there,
and this worker loads it (gateway/vllm_connector/remote_keys.py, known_keys.py), against a real
redis-server."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.core.fingerprint import BlockFingerprinter, Scope
from gateway.core.tokens import as_token_ids
from gateway.vllm_connector.deployment import ConnectorDeployment, ConnectorSettings
from gateway.vllm_connector.known_keys import KnownKeys
from gateway.vllm_connector.orders import LoadOrder, SaveOrder, WorkerReport
from gateway.vllm_connector.page_layout import VllmPageLayout
from gateway.vllm_connector.remote_keys import RedisKeyProbe
from gateway.vllm_connector.worker_cache import WorkerCache
from policies.base import BlockKey
from tests.redis_harness import RedisServer, free_port
from tests.vllm_worker.harness import SECRET_HEX, write_worker_config
from tiers.kinds.remote import RedisTierConfig

BLOCK = 32
LAYOUT = VllmPageLayout(vllm_version="0.32.0", backend="CPU_ATTN", isa="vec",
                        dtype=torch.float32, block_size=BLOCK, num_layers=2, kv_heads=2,
                        head_size=16)
TOKENS = tuple(range(3, 3 + 4 * BLOCK))


def replica(directory: Path, redis_url: str) -> ConnectorDeployment:
    tiers = f'\n[[cache.tier]]\nkind = "redis"\nurl = "{redis_url}"\n'
    config = write_worker_config(directory, block_tokens=BLOCK, extra_tiers=tiers)
    settings = ConnectorSettings(config_path=config, default_scope=None,
                                 model_fingerprint="tiny")
    return ConnectorDeployment.open(settings, LAYOUT, model="unused",
                                    env={"KVGATE_DEPLOYMENT_SECRET": SECRET_HEX})


def layers(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 2, BLOCK, 32, generator=generator) for _ in range(2)]


def keys(made: ConnectorDeployment) -> list[BlockKey]:
    fingerprinter = BlockFingerprinter(made.namespace_of(Scope.shared()), BLOCK)
    return list(fingerprinter.block_keys(as_token_ids(TOKENS)))


def store_through_first_replica(directory: Path, redis_url: str) -> list[torch.Tensor]:
    made = replica(directory, redis_url)
    source = layers(0)
    cache = WorkerCache(made.open_cache(running_pages=8), layers=source,
                        namespace_of=made.namespace_of)
    try:
        cache.save(SaveOrder(request_id="r", scope="shared", tokens=TOKENS,
                             block_ids=(0, 1, 2, 3)), WorkerReport())
    finally:
        cache.close()  # flushes the Redis writer
    return source


def test_a_chain_another_replica_stored_is_counted_and_loaded(
        tmp_path: Path, redis_server: RedisServer) -> None:
    source = store_through_first_replica(tmp_path / "first", redis_server.url)
    second = replica(tmp_path / "second", redis_server.url)
    redis = second.redis_tier()
    assert isinstance(redis, RedisTierConfig)
    known = KnownKeys(disk_roots=second.disk_roots(), remote=RedisKeyProbe(redis))
    digest = second.namespace_of(Scope.shared()).digest
    try:
        assert known.count_leading(keys(second), namespace_digest=digest) == 4
    finally:
        known.close()
    target = layers(1)
    cache = WorkerCache(second.open_cache(running_pages=8), layers=target,
                        namespace_of=second.namespace_of)
    try:
        outcome = cache.load(LoadOrder(request_id="q", scope="shared",
                                       tokens=TOKENS[:3 * BLOCK], block_ids=(5, 6, 7)),
                             WorkerReport())
    finally:
        cache.close()
    assert outcome.num_loaded == 3
    for got, stored in zip(target, source, strict=True):
        assert torch.equal(got[5:8], stored[0:3])


def test_redis_is_not_asked_for_another_namespaces_blocks(
        tmp_path: Path, redis_server: RedisServer) -> None:
    store_through_first_replica(tmp_path / "first", redis_server.url)
    second = replica(tmp_path / "second", redis_server.url)
    redis = second.redis_tier()
    assert redis is not None
    probe = RedisKeyProbe(redis)
    try:
        other = second.namespace_of(Scope.of_tenant("a")).digest
        assert probe.count_leading(other, keys(second)) == 0
    finally:
        probe.close()


def test_a_redis_that_does_not_answer_counts_nothing_and_is_left_alone(tmp_path: Path) -> None:
    now = [100.0]
    config = RedisTierConfig(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2,
                             retry_after_s=5.0)
    probe = RedisKeyProbe(config, clock=lambda: now[0])
    key = [BlockKey(b"\x01" * 16)]
    try:
        assert probe.count_leading(b"\x00" * 32, key) == 0
        assert probe._client is not None
        probe.close()
        assert probe.count_leading(b"\x00" * 32, key) == 0
        assert probe._client is None  # resting: not asked
        now[0] += 5.0
        probe.count_leading(b"\x00" * 32, key)
        assert probe._client is not None  # asked again after retry_after_s
    finally:
        probe.close()


@pytest.mark.parametrize("num_held", [0, 2, 4])
def test_redis_counts_from_the_first_block_it_lacks(
        tmp_path: Path, redis_server: RedisServer, num_held: int) -> None:
    made = replica(tmp_path, redis_server.url)
    redis = made.redis_tier()
    assert redis is not None
    digest = made.namespace_of(Scope.shared()).digest
    chain = keys(made)
    client = redis_server.client()
    for key in chain[:num_held]:
        client.set(f"{redis.key_prefix}:{digest.hex()}:{key.hex()}", b"x")
    probe = RedisKeyProbe(redis)
    try:
        assert probe.count_leading(digest, chain) == num_held
    finally:
        probe.close()
