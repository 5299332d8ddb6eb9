"""The engine: chat turns, tenants and the shared scope, warm/lookup/evict, sampling, stop
strings, refused and cancelled requests, a full queue, concurrent clients.

Parity from every tier, per prompt, is ``test_parity.py``; the prompts and helpers are in
``tests.gateway.engine.parity``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from gateway.cache.operations.admin import CacheAdmin, list_prefixes
from gateway.cache.operations.factory import OpenedCache
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest, QueueFull, RequestCancelled
from gateway.core.fingerprint import Scope
from gateway.core.requests import (
    SHARED_SCOPE_TIER,
    GenerateRequest,
    LookupRequest,
    SamplingParams,
    TokenDelta,
    Usage,
    WarmRequest,
)
from gateway.engine.engine import Engine
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import LoadedModel, forward_logits
from gateway.engine.models.loading import make_sequence_cache as sequence_cache
from tests.gateway.engine.parity import (
    ALICE,
    BLOCK,
    PROMPTS,
    make_engine,
    prompt_tokens,
    run,
)

BOB = Scope.of_tenant("bob")


def test_the_sequence_cache_computes_what_transformers_dynamic_cache_computes(
    tiny: LoadedModel,
) -> None:
    from transformers import DynamicCache

    ids = torch.randint(0, 400, (40,))
    reference: Any = DynamicCache(config=tiny.transformers_model().config)
    seq = KVSequence.alone(tiny.layout, 64)
    for start in range(0, 40, 8):
        a = forward_logits(tiny, ids[start : start + 8], reference)
        b = forward_logits(tiny, ids[start : start + 8], sequence_cache(seq))
        seq.advance(8)
        assert torch.equal(a, b)
    for layer in range(tiny.layout.num_layers):
        assert torch.equal(reference.layers[layer].keys[0], seq.keys(layer))


def test_the_next_chat_turn_hits_the_blocks_the_previous_answer_filled(
    engine: Engine, tiny: LoadedModel
) -> None:
    # Decode rows share the step's oneDNN product, so decoding writes the K/V a prefill writes
    # and an answer's full blocks are stored as it ends (with BLAS they are not:
    # tests/gateway/engine/test_batching.py).
    assert engine.route.name == "batched" and engine.route.decode_kv_is_prefill_kv
    first_turn = PromptInput(messages=[
        {"role": "user", "content": "Tell me something long about caches please."}])
    ids, _, usage = run(engine, first_turn, max_tokens=40)
    assert (usage.finish_reason, usage.completion_tokens) == ("length", 40)
    history = prompt_tokens(tiny, first_turn)
    tokens = [*history, *ids, 5, 6, 7]
    answered = (len(history) + len(ids) - 1) // BLOCK * BLOCK  # the last id is not fed back
    assert answered > len(history) // BLOCK * BLOCK  # the answer filled a block
    continued = PromptInput(token_ids=tokens)
    cold = run(engine, continued, no_cache=True)[:2]
    warm, text, usage2 = run(engine, continued)
    assert (warm, text) == cold
    # the answer's full blocks, and after them the tail the engine kept (the K/V up to the
    # answer's last token, which the turn computes with its new ones)
    assert engine.lookup(LookupRequest(prompt=continued, scope=ALICE)).cached_tokens >= answered
    assert usage2.cached_tokens_by_tier == {"device": len(history) + len(ids) - 1}


def test_tenants_never_hit_each_others_blocks(engine: Engine, tiny: LoadedModel) -> None:
    prompt = PROMPTS[1]
    num_full = len(prompt_tokens(tiny, prompt)) // BLOCK
    run(engine, prompt, scope=ALICE)
    assert run(engine, prompt, scope=ALICE)[2].cached_tokens == num_full * BLOCK  # control
    assert run(engine, prompt, scope=BOB)[2].cached_tokens == 0
    found = engine.lookup(LookupRequest(prompt=prompt, scope=BOB))
    assert found.cached_tokens == num_full * BLOCK  # bob's own, stored by his request
    assert engine.lookup(LookupRequest(prompt=PROMPTS[2], scope=BOB)).cached_tokens == 0


def test_no_cache_stores_nothing(engine: Engine, opened: OpenedCache) -> None:
    run(engine, PROMPTS[7], no_cache=True)
    assert opened.cache.stats().num_blocks == 0


def test_usage_counts_the_prompt_tokens_a_generation_stored(engine: Engine,
                                                             tiny: LoadedModel) -> None:
    prompt = PROMPTS[1]
    num_full = len(prompt_tokens(tiny, prompt)) // BLOCK
    assert num_full >= 2
    assert run(engine, prompt, no_cache=True)[2].stored_tokens == 0
    assert run(engine, prompt)[2].stored_tokens == num_full * BLOCK
    again = run(engine, prompt)[2]  # every block found cached: nothing new stored
    assert again.stored_tokens == 0 and again.cached_tokens == num_full * BLOCK


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
        long = engine.generate(GenerateRequest(prompt=PROMPTS[1], scope=ALICE,
                                               sampling=SamplingParams(max_tokens=300)))
        first = iter(long)
        next(first)  # the worker is busy with it
        engine.generate(GenerateRequest(prompt=PROMPTS[0], scope=ALICE))  # waits in the queue
        with pytest.raises(QueueFull):
            engine.generate(GenerateRequest(prompt=PROMPTS[0], scope=ALICE))
        long.cancel()
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
    engine: Engine, opened: OpenedCache, tiny: LoadedModel
) -> None:
    prompt = PROMPTS[7]
    num_full = len(prompt_tokens(tiny, prompt)) // BLOCK
    engine.warm(WarmRequest(prompt=prompt, scope=Scope.shared()))
    assert opened.cache.stats().num_blocks == num_full
    cold = run(engine, prompt, scope=BOB, no_cache=True)[:2]
    warm, text, usage = run(engine, prompt, scope=BOB)
    assert (warm, text) == cold
    # A tenant is not told which tier holds a shared block (that tells of other tenants).
    assert usage.cached_tokens_by_tier == {SHARED_SCOPE_TIER: num_full * BLOCK}
    looked_up = engine.lookup(LookupRequest(prompt=prompt, scope=ALICE))
    assert looked_up.cached_tokens_by_tier == {SHARED_SCOPE_TIER: num_full * BLOCK}
    assert engine.lookup(LookupRequest(prompt=prompt, scope=Scope.shared())
                         ).cached_tokens_by_tier == {"device": num_full * BLOCK}
    shared = list_prefixes(opened.cache, owner="shared")
    assert sum(p.num_blocks for p in shared) == num_full  # bob wrote only his own


def test_cancelling_after_the_answer_keeps_the_blocks_the_answer_filled(
    tiny: LoadedModel, opened: OpenedCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The serial route stores an answer's blocks when it ends (recomputed block-aligned).
    engine = make_engine(tiny, opened, route="serial")
    try:
        _cancel_after_the_answer(engine, tiny, monkeypatch)
    finally:
        engine.stop(grace_s=5)


def _cancel_after_the_answer(engine: Engine, tiny: LoadedModel,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    cancelled = threading.Event()
    assert engine._loop is not None and engine._loop._blocks is not None
    blocks = engine._loop._blocks
    store_answer = blocks.store_answer  # runs on the step loop's thread

    def after_the_cancel(*args: Any, **kwargs: Any) -> None:
        assert cancelled.wait(timeout=30)
        store_answer(*args, **kwargs)

    monkeypatch.setattr(blocks, "store_answer", after_the_cancel)
    prompt = PROMPTS[3]
    handle = engine.generate(GenerateRequest(prompt=prompt, scope=ALICE,
                                             sampling=SamplingParams(max_tokens=40)))
    events = list(handle)
    handle.cancel()  # what gRPC's end-of-call callback does, before the answer is stored
    cancelled.set()
    usage = events[-1]
    assert isinstance(usage, Usage)
    assert (usage.finish_reason, usage.completion_tokens) == ("length", 40)
    run(engine, PROMPTS[0], no_cache=True)  # queued behind it: the store has finished
    history = prompt_tokens(tiny, prompt)
    ids = [t for e in events if isinstance(e, TokenDelta) for t in e.token_ids]
    answer = PromptInput(token_ids=[*history, *ids])
    answered_blocks = (len(history) + 40 - 1) // BLOCK  # the last token's KV is never computed
    assert answered_blocks > len(history) // BLOCK
    found = engine.lookup(LookupRequest(prompt=answer, scope=ALICE))
    assert found.cached_tokens == answered_blocks * BLOCK
    assert found.num_prompt_blocks == (len(history) + 40) // BLOCK


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
