"""A hybrid's recurrent states travel in its blocks through every tier (issue 46): LFM2's conv
windows, kept in the blocks' K/V slots, and the scans' states of Qwen3.5's and Qwen3-Next's
Gated DeltaNet and Granite 4.0-H's and Falcon-H1's Mamba-2 (matrices and conv windows, in their
own slots and extra layers of the cache's layout; Falcon-H1's in extra layers only, its
attention's K/V in its own), are served
warm from the disk tier and from Redis (written by another engine) with the cold answer's bits,
and a block whose bytes were forged or cut short is refused as any block is (the request
answers cold)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.families.checkpoints import (
    save_falcon_h1,
    save_granite_hybrid,
    save_lfm2,
    save_qwen3_5,
    save_qwen3_next,
)
from tests.gateway.engine.parity import (
    BLOCK,
    SECRET,
    assert_served_equals_cold,
    assert_served_from_redis_by_another_engine_equals_cold,
    cache_config,
    evict_once_released,
    make_engine,
    run,
)
from tests.gateway.engine.test_forged_blocks import forged
from tests.redis_harness import RedisServer

HYBRIDS = {"lfm2": save_lfm2, "qwen3_5": save_qwen3_5, "qwen3_next": save_qwen3_next,
           "granite_hybrid": save_granite_hybrid, "falcon_h1": save_falcon_h1}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """Each hybrid family's tiny checkpoint, loaded for the tests' blocks."""
    path = HYBRIDS[request.param](tmp_path_factory.mktemp(request.param) / "model")
    return load_model(str(path), block_tokens=BLOCK)


@pytest.fixture()
def tiers(hybrid: LoadedModel, tmp_path: Path) -> Iterator[OpenedCache]:
    opened = open_cache(cache_config(tmp_path), layout=hybrid.layout, deployment_secret=SECRET,
                        device=torch.device("cpu"))
    yield opened
    opened.close()


def _prompt(num_tokens: int, salt: int = 0) -> PromptInput:
    return PromptInput(token_ids=[(11 * i + 3 + salt) % 400 for i in range(num_tokens)])


def test_a_warm_answer_from_the_disk_tier_equals_the_cold_one(
        hybrid: LoadedModel, tiers: OpenedCache, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make_engine(hybrid, tiers)
    try:
        prompt = _prompt(3 * BLOCK + 7)
        cold = run(engine, prompt, no_cache=True)[:2]
        assert run(engine, prompt)[:2] == cold
        evict_once_released(tiers, "device", "host")
        assert_served_equals_cold(hybrid, engine, tiers, monkeypatch, prompt, cold, "disk")
    finally:
        engine.stop(grace_s=5)


@pytest.mark.redis
def test_a_warm_answer_from_redis_written_by_another_engine_equals_the_cold_one(
        hybrid: LoadedModel, redis_server: RedisServer, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = _prompt(2 * BLOCK + 5, salt=1)
    assert_served_from_redis_by_another_engine_equals_cold(hybrid, redis_server.url, tmp_path,
                                                           monkeypatch, prompt)


@pytest.mark.parametrize("tamper", ["forged", "cut short"])
def test_a_block_with_forged_or_cut_short_bytes_is_refused_and_answered_cold(
        hybrid: LoadedModel, tmp_path: Path, tamper: str) -> None:
    prompt = _prompt(2 * BLOCK + 9, salt=2)
    first = open_cache(cache_config(tmp_path), layout=hybrid.layout, deployment_secret=SECRET)
    engine = make_engine(hybrid, first)
    cold, _, _ = run(engine, prompt, no_cache=True)
    run(engine, prompt)
    engine.stop()
    first.close()
    files = sorted((tmp_path / "disk").rglob("*.kvb"))
    assert files  # positive control: the blocks, their states in them, reached the disk
    for path in files:
        data = path.read_bytes()
        path.write_bytes(forged(data) if tamper == "forged" else data[:len(data) - 64])
    second = open_cache(cache_config(tmp_path), layout=hybrid.layout, deployment_secret=SECRET)
    engine = make_engine(hybrid, second)
    try:
        warm, _, usage = run(engine, prompt)
        assert warm == cold
        assert usage.cached_tokens_by_tier.get("disk", 0) == 0
    finally:
        engine.stop()
        second.close()


def test_a_generation_preempted_while_decoding_resumes_from_its_kept_states(
        hybrid: LoadedModel, tmp_path: Path) -> None:
    """Preempted, its full blocks (their states in them) go to the cache and its pages back to
    the pool; resumed, it continues from its last block's states to the same tokens."""
    from tests.gateway.engine.test_batching import start
    from tests.gateway.engine.test_preemption import (
        BULK_PROMPT,
        generation,
        preempted_while_decoding,
        unpreempted,
    )

    engine, opened = start(hybrid, tmp_path, BLOCK, max_running_per_tenant=1,
                           max_kv_share_per_tenant=1.0)
    try:
        bulk = generation(BULK_PROMPT, priority=5)
        expected = unpreempted(engine, bulk)
        tokens, usage = preempted_while_decoding(engine, bulk)
        assert tokens == expected
        assert usage.completion_tokens == len(expected)
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_a_conversations_next_turn_starts_after_its_tail_from_the_states_at_its_end(
        hybrid: LoadedModel, tmp_path: Path) -> None:
    import random

    from tests.gateway.engine.test_batching import SYSTEM, collect, request, start
    from tests.gateway.engine.test_conversation_tails import converse

    engine, opened = start(hybrid, tmp_path, BLOCK)
    try:
        assert engine.route.decode_kv_is_prefill_kv, engine.route.reason
        turn, held = converse(engine, SYSTEM[:45], random.Random(1))
        assert held % BLOCK != 0  # the answer ended inside a block
        ids, usage = collect(engine, request(turn))
        assert usage.cached_tokens == held
        cold, _ = collect(engine, request(turn, no_cache=True))
        assert ids == cold
        assert engine.tail_counters.num_hits == 1
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_lossy_tiers_are_refused_for_a_hybrid_naming_the_setting(hybrid: LoadedModel,
                                                                 tmp_path: Path) -> None:
    """A lossy format would quantize the states' bytes with the K/V: kvgate serve refuses it
    in one line (exit 2) rather than resume a warm start from numbers no layer computed."""
    from gateway.config.loader import load_serve_config
    from gateway.engine.models.loading import UnservableModel
    from gateway.service.assembly import refuse_lossy_states

    path = tmp_path / "kvgate.toml"
    path.write_text('[cache]\nquantize = { disk = "int8", redis = "none" }\n', encoding="utf-8")
    with pytest.raises(UnservableModel, match=r"exactly with lossy tiers \(disk = int8\): .* set "
                                              r"those tiers to \"none\" in \[cache\] quantize"):
        refuse_lossy_states(load_serve_config(path, env={}), hybrid)
    path.write_text('[cache]\nquantize = { disk = "none" }\n', encoding="utf-8")
    refuse_lossy_states(load_serve_config(path, env={}), hybrid)  # exact tiers: served
