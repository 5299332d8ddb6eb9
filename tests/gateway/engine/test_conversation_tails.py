"""A conversation's next turn starts where its last answer's K/V end, and still equals cold.

The engine keeps the K/V after a prompt + answer's last full block
(``gateway.engine.kv.tail_cache``) where decoding writes a prefill's K/V; the next turn, which sends
the answer back, then computes
only the last answer token and its new message.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.factory import OpenedCache
from gateway.core.canonical import PromptInput
from gateway.engine.engine import Engine
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.test_batching import (
    ALICE,
    BOB,
    SYSTEM,
    collect,
    random_prompt,
    request,
    start,
)
from tests.tiny_llama import save_tiny_llama

BLOCK = 16
Stack = tuple[Engine, OpenedCache]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture
def stack(tiny: LoadedModel, tmp_path: Path) -> Iterator[Stack]:
    """An engine with the default tail cache on a cache of 16-token blocks."""
    engine, opened = start(tiny, tmp_path, BLOCK)
    yield engine, opened
    engine.stop(grace_s=5)
    opened.close()


def converse(engine: Engine, prompt: list[int], rng: random.Random,
             answer_tokens: int = 21) -> tuple[list[int], int]:
    """Answer ``prompt``; the next turn (prompt, answer, a new message) and how many of its
    positions hold K/V after the answer (all but the answer's last token and the message)."""
    answer, _ = collect(engine, request(prompt, max_tokens=answer_tokens))
    turn = prompt + answer + random_prompt(rng, 5, 12)
    return turn, len(prompt) + len(answer) - 1


def test_the_next_turn_starts_after_the_kv_its_answer_left(stack: Stack) -> None:
    engine, _ = stack
    assert engine.route.decode_kv_is_prefill_kv, engine.route.reason
    turn, held = converse(engine, SYSTEM[:45], random.Random(1))
    assert held % BLOCK != 0  # the answer ended inside a block
    ids, usage = collect(engine, request(turn))
    assert usage.cached_tokens == held
    assert usage.cached_tokens_by_tier == {"device": held}
    cold, _ = collect(engine, request(turn, no_cache=True))
    assert ids == cold
    tails = engine.tail_counters
    assert (tails.num_hits, tails.num_tokens_served) == (1, held % BLOCK)


def test_blocks_stored_after_a_tail_equal_the_cold_computation(stack: Stack) -> None:
    engine, opened = stack
    rng = random.Random(2)
    turn = SYSTEM[:37]
    for _ in range(3):  # each turn continues the tail the previous one left
        turn, _ = converse(engine, turn, rng)
    collect(engine, request(turn, max_tokens=1))
    assert engine.tail_counters.num_hits == 3  # the second, third and last turns
    tokens = engine._canonical(PromptInput(token_ids=turn)).token_ids
    with opened.cache.acquire(engine._namespace(ALICE), tokens) as lease:
        stored = opened.cache.load(lease)
    cold = engine.cold_blocks(tokens)
    assert len(stored) == len(cold) == len(turn) // BLOCK
    for got, want in zip(stored, cold, strict=True):
        for a, b in zip((*got.keys, *got.values), (*want.keys, *want.values), strict=True):
            assert torch.equal(a, b)


def test_another_tenant_never_starts_after_a_tenants_tail(stack: Stack) -> None:
    engine, _ = stack
    turn, held = converse(engine, SYSTEM[:45], random.Random(3))
    _, theirs = collect(engine, request(turn, scope=BOB))
    assert theirs.cached_tokens == 0
    _, mine = collect(engine, request(turn))
    assert mine.cached_tokens == held


def test_a_tail_is_not_used_once_its_block_was_evicted(stack: Stack) -> None:
    engine, opened = stack
    turn, held = converse(engine, SYSTEM[:45], random.Random(4))
    CacheAdmin(opened.cache, keys=engine).evict(tenant="alice")
    full = held // BLOCK * BLOCK
    collect(engine, request(turn[:full], max_tokens=1))  # stores the blocks again, no tail
    _, usage = collect(engine, request(turn))
    assert usage.cached_tokens == full  # its blocks, not the tail kept before the eviction
    assert engine.tail_counters.num_hits == 0
    assert engine.tail_counters.num_dropped == 1  # found stale, dropped


@pytest.mark.parametrize("config", [{"tail_cache_bytes": 0}, {"linear_kernel": "blas"}])
def test_no_tail_is_kept_when_turned_off_or_decoding_differs_from_prefill(
        tiny: LoadedModel, tmp_path: Path, config: dict[str, object]) -> None:
    engine, opened = start(tiny, tmp_path, BLOCK, **config)
    try:
        turn, held = converse(engine, SYSTEM[:45], random.Random(5))
        _, usage = collect(engine, request(turn))
        assert usage.cached_tokens % BLOCK == 0 and usage.cached_tokens < held
        assert engine.tail_counters.num_kept == 0
    finally:
        engine.stop(grace_s=5)
        opened.close()
