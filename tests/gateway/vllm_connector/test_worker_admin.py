"""An operator's eviction reaches a vLLM worker's cache, its Redis copies and the scheduler's view
(gateway/vllm_connector/worker_admin.py, key_changes.py), against a real redis-server."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.invalidation import EventBounds, EvictionFeed
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import BlockFingerprinter, Scope
from gateway.core.tokens import as_token_ids
from gateway.vllm_connector.deployment import ConnectorDeployment, ConnectorSettings
from gateway.vllm_connector.key_changes import KeyChanges
from gateway.vllm_connector.orders import SaveOrder, WorkerReport
from gateway.vllm_connector.page_layout import VllmPageLayout
from gateway.vllm_connector.remote_keys import RedisKeyProbe
from gateway.vllm_connector.worker_admin import WorkerPromptKeys, follow_evictions
from gateway.vllm_connector.worker_cache import WorkerCache
from policies.base import BlockKey
from tests.redis_harness import RedisServer
from tests.tiny_llama import save_tiny_llama
from tests.vllm_worker.harness import SECRET_HEX, write_worker_config
from tiers.base import BlockMeta

BLOCK = 32
LAYOUT = VllmPageLayout(vllm_version="0.32.0", backend="CPU_ATTN", isa="vec",
                        dtype=torch.float32, block_size=BLOCK, num_layers=2, kv_heads=2,
                        head_size=16)
TOKENS = tuple(range(3, 3 + 4 * BLOCK))


def replica(directory: Path, redis_url: str | None = None, layout: VllmPageLayout = LAYOUT
            ) -> ConnectorDeployment:
    tiers = "" if redis_url is None else f'\n[[cache.tier]]\nkind = "redis"\nurl = "{redis_url}"\n'
    config = write_worker_config(directory, block_tokens=BLOCK, extra_tiers=tiers)
    settings = ConnectorSettings(config_path=config, default_scope=None,
                                 model_fingerprint="tiny")
    return ConnectorDeployment.open(settings, layout, model="unused",
                                    env={"KVGATE_DEPLOYMENT_SECRET": SECRET_HEX})


def keys_of(made: ConnectorDeployment, tenant: str) -> list[BlockKey]:
    fingerprinter = BlockFingerprinter(made.namespace_of(Scope.of_tenant(tenant)), BLOCK)
    return fingerprinter.block_keys(as_token_ids(TOKENS))


def layers() -> list[torch.Tensor]:
    return [torch.randn(8, 2, BLOCK, 32) for _ in range(2)]


def save(cache: WorkerCache, tenant: str) -> None:
    cache.save(SaveOrder(request_id=tenant, scope=f"tenant:{tenant}", tokens=TOKENS,
                         block_ids=(0, 1, 2, 3)), WorkerReport())


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[ConnectorDeployment, WorkerCache]]:
    made = replica(tmp_path)
    changes = KeyChanges()
    cache = WorkerCache(made.open_cache(running_pages=8, tier_events=changes), layers=layers(),
                        namespace_of=made.namespace_of, changes=changes)
    yield made, cache
    cache.close()


def meta(key: bytes) -> BlockMeta:
    return BlockMeta(key=BlockKey(key), parent_key=BlockKey(b""), namespace_digest=b"\x00" * 32,
                     owner="shared", tokens=bytes(4 * BLOCK))


def test_keys_removed_from_every_tier_are_reported_gone() -> None:
    changes = KeyChanges()
    changes.stored(meta(b"a"), "device")
    changes.stored(meta(b"b"), "device")
    changes.removed(BlockKey(b"b"), "device")
    changes.removed(BlockKey(b"c"), "device")
    held = {BlockKey(b"a"): ("device",), BlockKey(b"b"): ("disk",)}
    stored, gone = changes.drain(lambda key: held.get(key, ()))
    assert stored == {BlockKey(b"a"), BlockKey(b"b")}  # b was demoted, not lost
    assert gone == {BlockKey(b"c")}
    assert changes.drain(lambda key: ()) == (set(), set())  # drained


def test_a_save_is_reported_as_keys_the_worker_holds(
        worker: tuple[ConnectorDeployment, WorkerCache]) -> None:
    made, cache = worker
    save(cache, "a")
    report = WorkerReport()
    cache.report_changes(report)
    assert set(keys_of(made, "a")) <= report.stored and not report.lost


def test_an_operators_eviction_is_reported_as_keys_gone(
        worker: tuple[ConnectorDeployment, WorkerCache]) -> None:
    made, cache = worker
    save(cache, "a")
    save(cache, "b")
    cache.report_changes(WorkerReport())
    admin = CacheAdmin(cache._cache, keys=WorkerPromptKeys(made, None))
    admin.evict(tenant="a")
    report = WorkerReport()
    cache.report_changes(report)
    assert report.lost == set(keys_of(made, "a"))
    assert not report.lost & set(keys_of(made, "b"))


def test_a_prefix_text_is_tokenised_with_the_checkpoints_tokenizer(tmp_path: Path) -> None:
    made = replica(tmp_path / "replica")
    keys = WorkerPromptKeys(made, save_tiny_llama(tmp_path / "model"))
    tokens = keys.prompt_tokens(PromptInput(prompt="hello there"))
    assert len(tokens) > 0
    assert "hello" in keys.preview(list(tokens))


def test_an_eviction_published_while_the_worker_was_down_is_applied_before_it_serves(
        tmp_path: Path, redis_server: RedisServer) -> None:
    made = replica(tmp_path / "worker", redis_server.url)
    opened = made.open_cache(running_pages=8)
    cache = WorkerCache(opened, layers=layers(), namespace_of=made.namespace_of)
    feed = follow_evictions(opened, made, None)  # its cursor: the stream as it is now
    assert feed is not None
    save(cache, "a")
    feed.stop()
    cache.close()
    # another replica, whose namespaces are not the worker's (kvgate's own engine, say)
    publisher = replica(tmp_path / "gateway", redis_server.url,
                        layout=dataclasses.replace(LAYOUT, isa="another"))
    published = publisher.open_cache(running_pages=8)
    assert published.events is not None
    publisher_feed = EvictionFeed(published.events, lambda event: None,
                                  origin=secrets.token_hex(8),
                                  bounds=EventBounds(max_prefix_chars=1000,
                                                     max_tenant_chars=128))
    CacheAdmin(published.cache, keys=WorkerPromptKeys(publisher, None),
               feed=publisher_feed).evict(tenant="a")
    published.close()
    restarted = made.open_cache(running_pages=8)  # the disk still holds tenant a's blocks
    try:
        assert restarted.num_recovered_blocks == 4
        feed = follow_evictions(restarted, made, None)
        assert feed is not None
        deadline = time.monotonic() + 10
        while restarted.cache.stats().num_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert restarted.cache.stats().num_blocks == 0
        redis = made.redis_tier()
        assert redis is not None
        probe = RedisKeyProbe(redis)
        digest = made.namespace_of(Scope.of_tenant("a")).digest
        assert probe.count_leading(digest, keys_of(made, "a")) == 0  # Redis's copies too
        probe.close()
        feed.stop()
    finally:
        restarted.close()
