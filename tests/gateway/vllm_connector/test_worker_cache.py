"""kvgate's cache inside vLLM's worker: the scheduler's orders carried out on (synthetic) vLLM
pages over a real disk tier, and the deployment's checks (gateway/vllm_connector/worker_cache.py,
deployment.py, known_keys.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.core.fingerprint import BlockFingerprinter, Scope
from gateway.core.tokens import as_token_ids
from gateway.vllm_connector.deployment import (
    ConnectorDeployment,
    ConnectorRefused,
    ConnectorSettings,
)
from gateway.vllm_connector.known_keys import KnownKeys
from gateway.vllm_connector.orders import LoadOrder, SaveOrder, WorkerReport
from gateway.vllm_connector.page_layout import VllmPageLayout
from gateway.vllm_connector.worker_cache import WorkerCache
from policies.base import BlockKey
from tests.vllm_worker.harness import SECRET_HEX, write_worker_config
from tiers.disk_layout import ShardLayout
from tiers.fileops import RealFileOps

LAYERS, KV_HEADS, BLOCK, HEAD = 2, 2, 32, 16
VLLM_BLOCKS = 12
LAYOUT = VllmPageLayout(vllm_version="0.32.0", backend="CPU_ATTN", isa="vec",
                        dtype=torch.float32, block_size=BLOCK, num_layers=LAYERS,
                        kv_heads=KV_HEADS, head_size=HEAD)
TOKENS = tuple(range(3, 3 + 4 * BLOCK + 7))  # four whole blocks and a partial one


def deployment(directory: Path, *, block_tokens: int = BLOCK, extra_tiers: str = ""
               ) -> ConnectorDeployment:
    config = write_worker_config(directory, block_tokens=block_tokens, extra_tiers=extra_tiers)
    settings = ConnectorSettings(config_path=config, default_scope=None,
                                 model_fingerprint="tiny")
    return ConnectorDeployment.open(settings, LAYOUT, model="unused",
                                    env={"KVGATE_DEPLOYMENT_SECRET": SECRET_HEX})


def vllm_layers(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(VLLM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, generator=generator)
            for _ in range(LAYERS)]


@pytest.fixture
def made(tmp_path: Path) -> ConnectorDeployment:
    return deployment(tmp_path)


@pytest.fixture
def layers() -> list[torch.Tensor]:
    return vllm_layers(0)


@pytest.fixture
def cache(made: ConnectorDeployment, layers: list[torch.Tensor]) -> Iterator[WorkerCache]:
    opened = WorkerCache(made.open_cache(running_pages=8), layers=layers,
                         namespace_of=made.namespace_of)
    yield opened
    opened.close()


def keys_of(made: ConnectorDeployment, scope: str = "a") -> list[BlockKey]:
    return list(BlockFingerprinter(made.namespace_of(Scope.of_tenant(scope)), BLOCK).block_keys(
        as_token_ids(TOKENS)))


def save_order(scope: str = "tenant:a") -> SaveOrder:
    return SaveOrder(request_id="first", scope=scope, tokens=TOKENS[:4 * BLOCK],
                     block_ids=(1, 2, 3, 4))


def load_order(scope: str = "tenant:a") -> LoadOrder:
    return LoadOrder(request_id="second", scope=scope, tokens=TOKENS[:3 * BLOCK],
                     block_ids=(7, 8, 9))


def test_saved_pages_load_into_other_blocks_bit_for_bit(
        cache: WorkerCache, layers: list[torch.Tensor]) -> None:
    saved = [layer[1:4].clone() for layer in layers]
    cache.save(save_order(), WorkerReport())
    for layer in layers:
        layer[1:5].zero_()  # vLLM reuses the blocks
    outcome = cache.load(load_order(), WorkerReport())
    assert outcome.num_loaded == 3 and outcome.failed_block_ids == ()
    for layer, was in zip(layers, saved, strict=True):
        assert torch.equal(layer[7:10], was)


def test_a_save_reports_the_keys_the_cache_now_holds(cache: WorkerCache,
                                                     made: ConnectorDeployment) -> None:
    report = WorkerReport()
    assert cache.save(save_order(), report) == 4
    assert report.stored == set(keys_of(made)[:4])


def test_a_block_saved_twice_is_stored_once(cache: WorkerCache) -> None:
    cache.save(save_order(), WorkerReport())
    assert cache.save(save_order(), WorkerReport()) == 0


def test_another_scope_loads_nothing(cache: WorkerCache, made: ConnectorDeployment) -> None:
    cache.save(save_order("tenant:a"), WorkerReport())
    report = WorkerReport()
    outcome = cache.load(load_order("tenant:b"), report)
    assert outcome.num_loaded == 0 and outcome.failed_block_ids == (7, 8, 9)
    assert report.lost == {keys_of(made, "b")[0]}  # the first block it lacked


def test_a_corrupted_disk_block_cuts_the_load_and_is_reported(tmp_path: Path) -> None:
    made = deployment(tmp_path)
    writer = WorkerCache(made.open_cache(running_pages=8), layers=vllm_layers(0),
                         namespace_of=made.namespace_of)
    writer.save(save_order(), WorkerReport())
    writer.close()  # flushed to disk; a restart finds only the disk tier
    keys = keys_of(made)
    path = ShardLayout(str(tmp_path / "kv"), RealFileOps(), fsync=False).path_for(keys[1])
    data = bytearray(Path(path).read_bytes())
    data[-100] ^= 0x01  # one bit of the payload
    Path(path).write_bytes(bytes(data))
    restarted = deployment(tmp_path)
    target = vllm_layers(2)
    loader = WorkerCache(restarted.open_cache(running_pages=8), layers=target,
                         namespace_of=restarted.namespace_of)
    try:
        report = WorkerReport()
        outcome = loader.load(load_order(), report)
    finally:
        loader.close()
    assert outcome.num_loaded == 1 and outcome.failed_block_ids == (8, 9)
    assert report.lost == {keys[1]}


def test_the_scheduler_sees_blocks_on_disk_after_a_restart(tmp_path: Path) -> None:
    made = deployment(tmp_path)
    writer = WorkerCache(made.open_cache(running_pages=8), layers=vllm_layers(0),
                         namespace_of=made.namespace_of)
    writer.save(save_order(), WorkerReport())
    writer.close()
    keys = keys_of(made)
    known = KnownKeys(disk_roots=made.disk_roots())
    assert known.count_leading(keys) == 4
    known.forget([keys[2]])  # the worker found it wanting: its file is not believed
    assert known.count_leading(keys) == 2
    known.remember([keys[2]])  # stored again
    assert known.count_leading(keys) == 4


def test_known_keys_forget_the_oldest_past_their_limit() -> None:
    known = KnownKeys(max_remembered=2)
    known.remember([BlockKey(b"a"), BlockKey(b"b"), BlockKey(b"c")])
    assert len(known) == 2
    assert known.count_leading([BlockKey(b"a")]) == 0
    assert known.count_leading([BlockKey(b"b"), BlockKey(b"c")]) == 2


def test_a_block_size_other_than_vllms_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConnectorRefused, match="block_tokens is 64 and vLLM's block size 32"):
        deployment(tmp_path, block_tokens=64)


def test_a_lossy_tier_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConnectorRefused, match="lossy"):
        deployment(tmp_path, extra_tiers='quantize = "int8"')


def test_a_missing_kvgate_config_is_named(tmp_path: Path) -> None:
    settings = ConnectorSettings(config_path=tmp_path / "absent.toml", default_scope=None,
                                 model_fingerprint="tiny")
    with pytest.raises(ConnectorRefused, match="absent.toml does not exist"):
        ConnectorDeployment.open(settings, LAYOUT, model="unused", env={})


def test_a_model_without_a_fingerprint_is_refused(tmp_path: Path) -> None:
    settings = ConnectorSettings(config_path=write_worker_config(tmp_path, block_tokens=BLOCK),
                                 default_scope=None)
    with pytest.raises(ConnectorRefused, match="model_fingerprint"):
        ConnectorDeployment.open(settings, LAYOUT, model="org/some-hub-model",
                                 env={"KVGATE_DEPLOYMENT_SECRET": SECRET_HEX})


@pytest.mark.parametrize(("extra", "message"), [
    ({}, "kvgate_config must name"),
    ({"kvgate_config": "k.toml", "default_scope": "everyone"}, "default_scope"),
    ({"kvgate_config": "k.toml", "model_fingerprint": ""}, "model_fingerprint"),
])
def test_malformed_connector_settings_are_named(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConnectorRefused, match=message):
        ConnectorSettings.from_extra_config(extra)


def test_connector_settings_default_to_no_cache_for_unsigned_requests() -> None:
    settings = ConnectorSettings.from_extra_config({"kvgate_config": "k.toml"})
    assert settings.default_scope is None and settings.config_path == Path("k.toml")
    assert os.fspath(settings.config_path) == "k.toml"
