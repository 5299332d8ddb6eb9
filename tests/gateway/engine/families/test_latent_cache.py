"""A multi-head latent attention model's cache holds its latents, not expanded K/V (issue 43,
item 4): a cached token costs ``(kv_lora_rank + qk_rope_head_dim) x layers`` numbers in every
tier, as in the model's own cache; a warm answer from the disk tier and from Redis (written by
another engine) equals the cold one; only the tiled attention reads latents; the serial route
keeps the same latents (a block is the same bytes whichever route computed it)."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.engine.engine import Engine
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity.route_search import attention_names
from tests.gateway.engine.families.checkpoints import save_deepseek_v3
from tests.gateway.engine.parity import (
    BLOCK,
    SECRET,
    ServedSpy,
    assert_blocks_equal,
    assert_served_equals_cold,
    assert_served_from_redis_by_another_engine_equals_cold,
    cache_config,
    cold_blocks,
    evict_once_released,
    make_engine,
    num_servable_tokens,
    run,
)
from tests.redis_harness import RedisServer

LATENT = 32 + 8
"""The tiny DeepSeek-V3's numbers a token and layer: its kv_lora_rank and qk_rope_head_dim."""
EXPANDED = 4 * (16 + 8) + 4 * 12
"""What expanded K/V would cost a token and layer instead: 4 heads' keys (nope + rope) and
values."""
RAW_LENGTH_AT = 44
"""Where a stored block's header keeps its payload's raw length (``tiers.block_format``)."""
MAGIC = b"KVGB"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_deepseek_v3(tmp_path_factory.mktemp("deepseek") / "model")))


@pytest.fixture()
def tiers(loaded: LoadedModel, tmp_path: Path) -> Iterator[OpenedCache]:
    opened = open_cache(cache_config(tmp_path), layout=loaded.layout, deployment_secret=SECRET,
                        device=torch.device("cpu"))
    yield opened
    opened.close()


def _prompt(num_tokens: int) -> PromptInput:
    return PromptInput(token_ids=[(7 * i + 5) % 400 for i in range(num_tokens)])


def test_a_cached_token_costs_the_models_latent(loaded: LoadedModel) -> None:
    layers = loaded.layout.num_layers
    assert loaded.layout.bytes_per_token == LATENT * layers * 4
    assert loaded.layout.bytes_per_token < EXPANDED * layers * 4


def test_every_tier_stores_a_block_as_its_latents(loaded: LoadedModel, tiers: OpenedCache,
                                                  tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(loaded, tiers)
    try:
        prompt = _prompt(3 * BLOCK + 5)
        run(engine, prompt)
        spy = ServedSpy(tiers.cache).install(monkeypatch)
        run(engine, prompt)
    finally:
        engine.stop(grace_s=5)
    latent_block = BLOCK * LATENT * loaded.layout.num_layers * 4
    assert {block.nbytes for block in spy.only.blocks} == {latent_block}
    stored = [path.read_bytes() for path in (tmp_path / "disk").rglob("*") if path.is_file()]
    blocks = [data for data in stored if data.startswith(MAGIC)]
    assert blocks, "the disk tier holds the prompt's blocks"
    raw_lengths = {struct.unpack_from("<Q", data, RAW_LENGTH_AT)[0] for data in blocks}
    assert raw_lengths == {latent_block}


def test_a_warm_answer_from_the_disk_tier_equals_the_cold_one(
        loaded: LoadedModel, tiers: OpenedCache, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(loaded, tiers)
    try:
        prompt = _prompt(2 * BLOCK + 11)
        cold = run(engine, prompt, no_cache=True)[:2]
        assert run(engine, prompt)[:2] == cold
        evict_once_released(tiers, "device", "host")
        assert_served_equals_cold(loaded, engine, tiers, monkeypatch, prompt, cold, "disk")
    finally:
        engine.stop(grace_s=5)


def test_a_warm_answer_from_redis_written_by_another_engine_equals_the_cold_one(
        loaded: LoadedModel, redis_server: RedisServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _prompt(2 * BLOCK + 3)
    assert_served_from_redis_by_another_engine_equals_cold(loaded, redis_server.url, tmp_path,
                                                           monkeypatch, prompt)


def test_only_the_tiled_attention_reads_latent_pages() -> None:
    assert attention_names(torch.device("cpu"), torch.float32, LATENT // 2,
                           latent=True) == ["tiled"]


def test_the_serial_route_keeps_the_same_latents_and_answers_warm_as_cold(
        loaded: LoadedModel, tiers: OpenedCache, monkeypatch: pytest.MonkeyPatch) -> None:
    engine: Engine = make_engine(loaded, tiers, route="serial")
    try:
        prompt = _prompt(2 * BLOCK + 9)
        cold = run(engine, prompt, no_cache=True)[:2]
        assert run(engine, prompt)[:2] == cold
        spy = ServedSpy(tiers.cache).install(monkeypatch)
        assert run(engine, prompt)[:2] == cold
    finally:
        engine.stop(grace_s=5)
    tokens = list(prompt.token_ids or [])
    num_blocks = num_servable_tokens(len(tokens)) // BLOCK
    assert_blocks_equal(spy.only.blocks,
                        cold_blocks(loaded, tokens, num_blocks, route="serial"))
