"""The engine: warm equals cold, token for token and K/V bit for bit, from every tier.

The oracle is the same engine with the cache off (``no_cache``). Prompts cover multi-turn chat,
Unicode, a prompt of exactly N x block_tokens, one shorter than a block, one longer than 4 blocks
and two prompts sharing a system prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.cache.admin import CacheAdmin, list_prefixes
from gateway.cache.factory import CacheConfig, OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest, QueueFull, RequestCancelled
from gateway.core.fingerprint import Scope
from gateway.core.requests import (
    CacheOptions,
    GenerateRequest,
    LookupRequest,
    SamplingParams,
    TokenDelta,
    Usage,
    WarmRequest,
)
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.kv_sequence import KVSequence
from gateway.engine.model import LoadedModel, forward_logits, load_model
from gateway.engine.model import make_sequence_cache as sequence_cache
from tests.redis_harness import RedisServer
from tests.tiny_llama import save_tiny_llama

BLOCK = 16
SECRET = b"engine-test-secret-0000000000001"
ALICE = Scope.of_tenant("alice")
BOB = Scope.of_tenant("bob")
SYSTEM = "You are a careful assistant. Answer briefly and cite the manual. " * 2

PROMPTS: list[PromptInput] = [
    PromptInput(prompt="short"),
    PromptInput(prompt="The quick brown fox jumps over the lazy dog. " * 8),
    PromptInput(prompt="Ünïcödé ✓ — 東京 🚀 naïve café " * 3),
    PromptInput(messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "What is a block?"}]),
    PromptInput(messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "What is a tier?"}]),
    PromptInput(messages=[
        {"role": "user", "content": "Hi there, tell me about caches."},
        {"role": "assistant", "content": "Caches keep results so they are not computed again."},
        {"role": "user", "content": "And prefix caches?"},
    ]),
    PromptInput(token_ids=list(range(3 * BLOCK))),  # exactly N x block_tokens
    PromptInput(token_ids=[(7 * i) % 400 for i in range(5 * BLOCK + 3)]),  # > 4 blocks
    PromptInput(token_ids=[(11 * i) % 400 for i in range(BLOCK - 1)]),  # < 1 block
    PromptInput(prompt="a" * 40),
    PromptInput(prompt="Line one\r\nLine two\r\n" * 5),
    PromptInput(messages=[{"role": "user", "content": "Count: " + " ".join(map(str, range(40)))}]),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def cache_config(root: Path, **overrides: object) -> CacheConfig:
    fields: dict[str, object] = {
        "block_tokens": BLOCK,
        "device_bytes": 64 << 20,
        "host_bytes": 64 << 20,
        "disk_bytes": 256 << 20,
        "disk_path": root / "disk",
    }
    fields.update(overrides)
    return CacheConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
def opened(tiny: LoadedModel, tmp_path: Path) -> Iterator[OpenedCache]:
    cache = open_cache(cache_config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    yield cache
    cache.close()


def make_engine(tiny: LoadedModel, opened: OpenedCache | None, **overrides: object) -> Engine:
    config = EngineConfig(block_tokens=BLOCK, **overrides)  # type: ignore[arg-type]
    engine = Engine(loaded=tiny, cache=opened.cache if opened else None, config=config,
                    deployment_secret=SECRET)
    engine.start()
    return engine


@pytest.fixture
def engine(tiny: LoadedModel, opened: OpenedCache) -> Iterator[Engine]:
    e = make_engine(tiny, opened)
    yield e
    e.stop(grace_s=5)


def run(engine: Engine, prompt: PromptInput, *, scope: Scope = ALICE, no_cache: bool = False,
        max_tokens: int = 12, **sampling: object) -> tuple[list[int], str, Usage]:
    handle = engine.generate(GenerateRequest(
        prompt=prompt, scope=scope,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        cache=CacheOptions(no_cache=no_cache)))
    ids: list[int] = []
    text = ""
    usage = None
    for event in handle:
        if isinstance(event, TokenDelta):
            ids.extend(event.token_ids)
            text += event.text
        else:
            usage = event
    assert usage is not None
    return ids, text, usage


def test_the_sequence_cache_computes_what_transformers_dynamic_cache_computes(
    tiny: LoadedModel,
) -> None:
    from transformers import DynamicCache

    ids = torch.randint(0, 400, (40,))
    reference: Any = DynamicCache(config=tiny.model.config)
    seq = KVSequence(tiny.layout, 64)
    for start in range(0, 40, 8):
        a = forward_logits(tiny, ids[start : start + 8], reference)
        b = forward_logits(tiny, ids[start : start + 8], sequence_cache(seq))
        seq.advance(8)
        assert torch.equal(a, b)
    for layer in range(tiny.layout.num_layers):
        assert torch.equal(reference.layers[layer].keys[0], seq.keys(layer))


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_warm_output_equals_cold_output_token_for_token(engine: Engine, index: int) -> None:
    prompt = PROMPTS[index]
    cold, cold_text, _ = run(engine, prompt, no_cache=True)
    first, _, _ = run(engine, prompt)
    warm, warm_text, usage = run(engine, prompt)
    assert first == cold
    assert warm == cold and warm_text == cold_text
    full_blocks = usage.prompt_tokens // BLOCK
    expected_cached = min(full_blocks, (usage.prompt_tokens - 1) // BLOCK) * BLOCK
    assert usage.cached_tokens == expected_cached


def test_every_cached_block_equals_a_cold_computation_bit_for_bit(
    engine: Engine, opened: OpenedCache, tiny: LoadedModel
) -> None:
    prompt = PROMPTS[7]
    run(engine, prompt)
    cold = [(b.keys, b.values) for b in engine.cold_blocks(engine._canonical(prompt).token_ids)]
    cache = opened.cache
    ns = engine._namespace(ALICE)
    with cache.acquire(ns, engine._canonical(prompt).token_ids) as lease:
        stored = cache.load(lease)
    assert len(stored) == len(cold) == 5
    for block, (keys, values) in zip(stored, cold, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(block.keys + block.values, keys + values,
                                                     strict=True))


def test_warm_equals_cold_from_host_and_disk(tiny: LoadedModel, tmp_path: Path) -> None:
    block_bytes = tiny.layout.block_nbytes(BLOCK)
    opened = open_cache(cache_config(tmp_path, device_bytes=6 * block_bytes,
                                     host_bytes=6 * block_bytes),
                        layout=tiny.layout, deployment_secret=SECRET)
    engine = make_engine(tiny, opened)
    try:
        prompt = PROMPTS[7]
        cold, _, _ = run(engine, prompt, no_cache=True)
        run(engine, prompt)
        for filler in PROMPTS[1:3] + PROMPTS[9:11]:
            run(engine, filler)  # push the prompt out of the device tier
        warm, _, usage = run(engine, prompt)
        assert warm == cold
        assert set(usage.cached_tokens_by_tier) - {"device"}, usage.cached_tokens_by_tier
    finally:
        engine.stop()
        opened.close()


def test_warm_equals_cold_from_disk_after_a_restart(tiny: LoadedModel, tmp_path: Path) -> None:
    prompt = PROMPTS[1]
    first = open_cache(cache_config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    engine = make_engine(tiny, first)
    cold, _, _ = run(engine, prompt, no_cache=True)
    run(engine, prompt)
    engine.stop()
    first.close()
    second = open_cache(cache_config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    engine = make_engine(tiny, second)
    try:
        warm, _, usage = run(engine, prompt)
        assert warm == cold
        assert usage.cached_tokens_by_tier.get("disk", 0) == usage.cached_tokens > 0
    finally:
        engine.stop()
        second.close()


@pytest.mark.redis
def test_warm_equals_cold_from_redis_written_by_another_gateway(
    tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer
) -> None:
    prompt = PROMPTS[3]
    a_cache = open_cache(cache_config(tmp_path / "a", redis_url=redis_server.url, disk_bytes=0),
                         layout=tiny.layout, deployment_secret=SECRET)
    b_cache = open_cache(cache_config(tmp_path / "b", redis_url=redis_server.url, disk_bytes=0),
                         layout=tiny.layout, deployment_secret=SECRET)
    a, b = make_engine(tiny, a_cache), make_engine(tiny, b_cache)
    try:
        cold, _, _ = run(b, prompt, no_cache=True)
        run(a, prompt)
        assert a_cache.hierarchy.flush(timeout_s=10)
        warm, _, usage = run(b, prompt)
        assert warm == cold
        assert usage.cached_tokens_by_tier.get("redis", 0) == usage.cached_tokens > 0
    finally:
        a.stop()
        b.stop()
        a_cache.close()
        b_cache.close()


def test_the_next_chat_turn_hits_the_blocks_of_the_previous_answer(engine: Engine) -> None:
    first_turn = [{"role": "user", "content": "Tell me something long about caches please."}]
    ids, text, usage = run(engine, PromptInput(messages=first_turn), max_tokens=40)
    history = engine._canonical(PromptInput(messages=first_turn)).token_ids
    continued = PromptInput(token_ids=[*map(int, history), *ids, 5, 6, 7])
    cold, _, _ = run(engine, continued, no_cache=True)
    warm, _, usage2 = run(engine, continued)
    assert warm == cold
    assert usage2.cached_tokens > (usage.prompt_tokens // BLOCK) * BLOCK


def test_tenants_never_hit_each_others_blocks(engine: Engine) -> None:
    prompt = PROMPTS[1]
    run(engine, prompt, scope=ALICE)
    assert run(engine, prompt, scope=ALICE)[2].cached_tokens > 0  # positive control
    assert run(engine, prompt, scope=BOB)[2].cached_tokens == 0
    assert engine.lookup(LookupRequest(prompt=prompt, scope=BOB)).cached_tokens > 0  # bob's own
    assert engine.lookup(LookupRequest(prompt=PROMPTS[2], scope=BOB)).cached_tokens == 0


def test_no_cache_stores_nothing(engine: Engine, opened: OpenedCache) -> None:
    run(engine, PROMPTS[7], no_cache=True)
    assert opened.cache.stats().num_blocks == 0


def test_warm_stores_pins_and_lookup_reports_it(engine: Engine, opened: OpenedCache) -> None:
    prompt = PROMPTS[7]
    result = engine.warm(WarmRequest(prompt=prompt, scope=ALICE, pin=True))
    assert (result.num_blocks, result.num_new_blocks, result.num_cached_blocks) == (5, 5, 0)
    again = engine.warm(WarmRequest(prompt=prompt, scope=ALICE))
    assert (again.num_new_blocks, again.num_cached_blocks) == (0, 5)
    found = engine.lookup(LookupRequest(prompt=prompt, scope=ALICE))
    assert found.cached_tokens == 5 * BLOCK and found.diverges_at_block is None
    assert opened.cache.evict("device", 10**9).victims == ()  # pinned


def test_lookup_says_where_a_prompt_diverges(engine: Engine) -> None:
    base = [(7 * i) % 400 for i in range(4 * BLOCK)]
    engine.warm(WarmRequest(prompt=PromptInput(token_ids=base), scope=ALICE))
    changed = base[: 2 * BLOCK + 3] + [1, 2, 3] + base[2 * BLOCK + 6 :]
    found = engine.lookup(LookupRequest(prompt=PromptInput(token_ids=changed), scope=ALICE))
    assert found.diverges_at_block == 2
    assert found.cached_tokens == 2 * BLOCK
    assert found.text_around_divergence


def test_sampling_with_a_seed_is_reproducible(engine: Engine) -> None:
    a = run(engine, PROMPTS[1], temperature=0.9, top_p=0.9, top_k=50, seed=7)[0]
    b = run(engine, PROMPTS[1], temperature=0.9, top_p=0.9, top_k=50, seed=7)[0]
    assert a == b


def test_stop_strings_end_the_output_before_them(engine: Engine) -> None:
    _, text, _ = run(engine, PROMPTS[1], max_tokens=30)
    assert len(text) > 4
    stop = text[2:4]
    _, stopped, usage = run(engine, PROMPTS[1], max_tokens=30, stop=(stop,))
    assert stop not in stopped and text.startswith(stopped)
    assert usage.finish_reason == "stop"


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"max_tokens": 5000}, "context"),
    ],
)
def test_out_of_range_sampling_is_refused_before_queueing(
    engine: Engine, sampling: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        engine.generate(GenerateRequest(prompt=PROMPTS[0], scope=ALICE,
                                        sampling=SamplingParams(**sampling)))  # type: ignore[arg-type]


def test_a_cancelled_request_releases_every_reference(
    engine: Engine, opened: OpenedCache
) -> None:
    run(engine, PROMPTS[7])
    handle = engine.generate(GenerateRequest(prompt=PROMPTS[7], scope=ALICE,
                                             sampling=SamplingParams(max_tokens=500)))
    events = iter(handle)
    next(events)
    handle.cancel()
    with pytest.raises(RequestCancelled):
        for _ in events:
            pass
    run(engine, PROMPTS[0])  # the worker is free again
    assert opened.cache.total_refcount() == 0


def test_a_full_queue_refuses_new_requests(tiny: LoadedModel) -> None:
    engine = make_engine(tiny, None, max_queue=1)
    try:
        gate = threading.Event()
        long = engine.generate(GenerateRequest(prompt=PROMPTS[1], scope=ALICE,
                                               sampling=SamplingParams(max_tokens=300)))
        first = iter(long)
        next(first)  # the worker is busy with it
        engine.generate(GenerateRequest(prompt=PROMPTS[0], scope=ALICE))  # waits in the queue
        with pytest.raises(QueueFull):
            engine.generate(GenerateRequest(prompt=PROMPTS[0], scope=ALICE))
        long.cancel()
        gate.set()
    finally:
        engine.stop(grace_s=1)


def test_eight_concurrent_clients_get_their_sequential_outputs(engine: Engine) -> None:
    prompts = PROMPTS[:8]
    expected = [run(engine, p, no_cache=True)[0] for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            results[i] = run(engine, prompts[i])[0]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert [results[i] for i in range(8)] == expected


def test_a_shared_prompt_is_read_by_every_tenant_and_never_written_by_them(
    engine: Engine, opened: OpenedCache
) -> None:
    prompt = PROMPTS[7]
    engine.warm(WarmRequest(prompt=prompt, scope=Scope.shared()))
    shared_blocks = opened.cache.stats().num_blocks
    cold, _, _ = run(engine, prompt, scope=BOB, no_cache=True)
    warm, _, usage = run(engine, prompt, scope=BOB)
    assert warm == cold and usage.cached_tokens > 0
    assert engine.lookup(LookupRequest(prompt=prompt, scope=ALICE)).cached_tokens > 0
    shared = [p for p in list_prefixes(opened.cache, owner="shared")]
    assert sum(p.num_blocks for p in shared) == shared_blocks  # bob wrote only his own


def test_cancelling_after_the_answer_keeps_its_blocks(engine: Engine) -> None:
    handle = engine.generate(GenerateRequest(prompt=PROMPTS[3], scope=ALICE,
                                             sampling=SamplingParams(max_tokens=40)))
    events = list(handle)
    handle.cancel()  # what gRPC's end-of-call callback does
    assert isinstance(events[-1], Usage)
    ids = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    history = engine._canonical(PROMPTS[3]).token_ids
    continued = PromptInput(token_ids=[*map(int, history), *ids, 1])
    assert run(engine, continued)[2].cached_tokens >= len(history) // BLOCK * BLOCK


def test_evicting_a_prefix_removes_its_own_blocks_and_everything_after_it(
    engine: Engine, opened: OpenedCache,
) -> None:
    """The cache's admin, keyed by this engine (prefix text canonicalised as requests are)."""
    text = "The quick brown fox jumps over the lazy dog. " * 8
    engine.warm(WarmRequest(prompt=PromptInput(prompt=text), scope=ALICE))
    longer = PromptInput(prompt=text + "And then it ran far away into the forest. " * 4)
    engine.warm(WarmRequest(prompt=longer, scope=ALICE))
    other = PromptInput(prompt="A different prompt entirely, about caches. " * 8)
    engine.warm(WarmRequest(prompt=other, scope=ALICE))
    result = CacheAdmin(opened.cache, keys=engine).evict(tenant="alice", prefix_text=text)
    assert result.num_blocks == engine.lookup(LookupRequest(prompt=longer, scope=BOB)
                                              ).num_prompt_blocks
    assert engine.lookup(LookupRequest(prompt=longer, scope=ALICE)).cached_tokens == 0
    assert engine.lookup(LookupRequest(prompt=other, scope=ALICE)).cached_tokens > 0
