"""Many requests at once: the same answers as alone, warm still equal to cold, fair, cancellable.

The engine batches every running request into each step (``gateway.engine.scheduling.loop``); these
tests run requests concurrently from threads on the tiny Llama and compare against the same requests
run alone, token for token and K/V bit for bit.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.errors import DeadlineExceeded, RequestCancelled
from gateway.core.fingerprint import Scope
from gateway.core.requests import (
    CacheOptions,
    GenerateRequest,
    SamplingParams,
    TokenDelta,
    Usage,
    WarmRequest,
)
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.kernels import batched_kernels
from tests.gateway.engine.parity import SECRET, cache_config
from tests.tiny_llama import save_tiny_llama
from tiers.payload import KVBlock

ALICE = Scope.of_tenant("alice")
BOB = Scope.of_tenant("bob")
SYSTEM = [(5 * i + 3) % 400 for i in range(70)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def start(tiny: LoadedModel, root: Path, block: int, **config: object
          ) -> tuple[Engine, OpenedCache]:
    """An engine on the batched route: this machine's kernels where its search finds one that
    holds, else kernels that keep every row by construction (``ROWWISE_KERNELS``), so that the
    step loop's batching is tested on every machine."""
    opened = open_cache(cache_config(root, block_tokens=block), layout=tiny.layout,
                        deployment_secret=SECRET)
    kernel = str(config.get("linear_kernel", "auto"))
    engine = Engine(loaded=tiny, cache=opened.cache, pool=opened.pool,
                    config=EngineConfig(block_tokens=block, **config),  # type: ignore[arg-type]
                    deployment_secret=SECRET,
                    kernels=batched_kernels(tiny, kernel))  # type: ignore[arg-type]
    engine.start()
    assert engine.route.name == "batched", engine.route.reason
    return engine, opened


@pytest.fixture
def stack(tiny: LoadedModel, tmp_path: Path) -> Iterator[tuple[Engine, OpenedCache]]:
    engine, opened = start(tiny, tmp_path, 16)
    yield engine, opened
    engine.stop(grace_s=5)
    opened.close()


def request(tokens: list[int], *, scope: Scope = ALICE, max_tokens: int = 10,
            no_cache: bool = False) -> GenerateRequest:
    return GenerateRequest(prompt=PromptInput(token_ids=tokens), scope=scope,
                           sampling=SamplingParams(max_tokens=max_tokens),
                           cache=CacheOptions(no_cache=no_cache))


def collect(engine: Engine, req: GenerateRequest) -> tuple[list[int], Usage]:
    ids: list[int] = []
    usage = None
    for event in engine.generate(req):
        if isinstance(event, TokenDelta):
            ids.extend(event.token_ids)
        else:
            usage = event
    assert usage is not None
    return ids, usage


def concurrently(engine: Engine, requests: list[GenerateRequest]
                 ) -> list[tuple[list[int], Usage]]:
    results: list[tuple[list[int], Usage] | None] = [None] * len(requests)
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(requests))

    def one(i: int) -> None:
        try:
            barrier.wait()
            results[i] = collect(engine, requests[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def random_prompt(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(400) for _ in range(rng.randint(lo, hi))]


@pytest.mark.parametrize("block", [16, 32, 64])
def test_a_request_gets_the_same_greedy_tokens_alone_and_among_others(tiny, tmp_path,
                                                                      block) -> None:
    engine, opened = start(tiny, tmp_path, block)
    try:
        rng = random.Random(block)
        mine = request(SYSTEM + random_prompt(rng, 5, 30), no_cache=True, max_tokens=12)
        alone, _ = collect(engine, mine)
        for num_others in (1, 3, 7):
            others = [request(random_prompt(rng, 3, 150), no_cache=True,
                              max_tokens=rng.randint(1, 20)) for _ in range(num_others)]
            together = concurrently(engine, [*others, mine])
            assert together[-1][0] == alone, f"with {num_others} others"
        assert engine.counters.max_sequences_in_step >= 4
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_warm_equals_cold_with_batching_on(stack) -> None:
    engine, _ = stack
    rng = random.Random(7)
    prompts = [SYSTEM + random_prompt(rng, 10, 60) for _ in range(6)]
    cold = concurrently(engine, [request(p, no_cache=True) for p in prompts])
    first = concurrently(engine, [request(p) for p in prompts])
    warm = concurrently(engine, [request(p) for p in prompts])
    for (cold_ids, _), (first_ids, _), (warm_ids, usage) in zip(cold, first, warm,
                                                                strict=True):
        assert first_ids == cold_ids
        assert warm_ids == cold_ids
        assert usage.cached_tokens >= 64


def test_every_block_stored_under_batching_equals_the_cold_computation(stack) -> None:
    engine, opened = stack
    rng = random.Random(8)
    prompts = [SYSTEM + random_prompt(rng, 20, 80) for _ in range(5)]
    concurrently(engine, [request(p, max_tokens=20) for p in prompts])
    for prompt in prompts:
        tokens = engine._canonical(PromptInput(token_ids=prompt)).token_ids
        cold = engine.cold_blocks(tokens)
        with opened.cache.acquire(engine._namespace(ALICE), tokens) as lease:
            stored = opened.cache.load(lease)
        assert len(stored) == len(cold) == len(prompt) // 16
        for got, want in zip(stored, cold, strict=True):
            for a, b in zip((*got.keys, *got.values), (*want.keys, *want.values), strict=True):
                assert torch.equal(a, b)


def _answer_turn(engine: Engine, opened: OpenedCache
                 ) -> tuple[list[int], list[int], Callable[[], list[KVBlock]]]:
    """Generate an answer to a 40-token prompt; the prompt, the next turn (prompt, answer and
    10 more tokens), and what the cache holds of that next turn."""
    prompt = SYSTEM[:40]
    ids, _ = collect(engine, request(prompt, max_tokens=40))
    turn = prompt + ids + SYSTEM[40:50]
    everything = engine._canonical(PromptInput(token_ids=turn)).token_ids

    def stored_blocks() -> list[KVBlock]:
        with opened.cache.acquire(engine._namespace(ALICE), everything) as lease:
            return opened.cache.load(lease)

    return prompt, turn, stored_blocks


def _assert_equal_to_cold(engine: Engine, turn: list[int], stored: list[KVBlock]) -> None:
    cold = engine.cold_blocks(engine._canonical(PromptInput(token_ids=turn)).token_ids)
    for got, want in zip(stored, cold[:len(stored)], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got.keys, want.keys, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got.values, want.values, strict=True))


def test_an_answers_blocks_are_stored_as_decoded_and_equal_a_cold_prefills(stack) -> None:
    engine, opened = stack
    # oneDNN's products put decode rows beside prefill rows: decoding writes a prefill's K/V.
    assert engine.route.decode_kv_is_prefill_kv, engine.route.reason
    prompt, turn, stored_blocks = _answer_turn(engine, opened)
    stored = stored_blocks()
    # the prompt's 2 blocks and the 2 full blocks after it that the answer filled (the last
    # answer token is sampled, never fed back: 40 + 39 positions hold K/V)
    assert len(stored) == (len(prompt) + 40 - 1) // 16 == 4
    _assert_equal_to_cold(engine, turn, stored)


def test_with_blas_an_answers_blocks_come_from_the_next_turns_prefill(tiny, tmp_path) -> None:
    engine, opened = start(tiny, tmp_path, 16, linear_kernel="blas")
    try:
        assert not engine.route.decode_kv_is_prefill_kv  # decode rows are products of their own
        prompt, turn, stored_blocks = _answer_turn(engine, opened)
        assert len(stored_blocks()) == len(prompt) // 16  # the answer's own blocks: not stored
        collect(engine, request(turn, max_tokens=1))  # the next turn sends the answer back
        stored = stored_blocks()
        assert len(stored) == (len(turn) - 1) // 16 >= 5
        _assert_equal_to_cold(engine, turn, stored)
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_cancelling_one_request_mid_batch_frees_its_blocks_and_changes_no_other(stack) -> None:
    engine, opened = stack
    rng = random.Random(9)
    others = [request(SYSTEM + random_prompt(rng, 5, 20), no_cache=True, max_tokens=15)
              for _ in range(3)]
    alone = [collect(engine, r)[0] for r in others]
    victim = engine.generate(request(SYSTEM + [1, 2, 3], max_tokens=400))
    results: list[list[int]] = []
    runner = threading.Thread(target=lambda: results.extend(
        r[0] for r in concurrently(engine, others)))
    runner.start()
    events = iter(victim)
    next(events)  # it is decoding
    victim.cancel()
    with pytest.raises(RequestCancelled):
        for _ in events:
            pass
    runner.join(timeout=120)
    assert results == alone
    assert opened.cache.total_refcount() == 0


def test_a_flooding_tenant_does_not_hold_back_another_tenants_request(tiny, tmp_path) -> None:
    engine, opened = start(tiny, tmp_path, 16, max_running=8, max_running_per_tenant=6)
    try:
        rng = random.Random(10)
        flood = [engine.generate(request(random_prompt(rng, 100, 200), max_tokens=300,
                                         no_cache=True)) for _ in range(6)]
        for handle in flood:
            next(iter(handle))  # every flood request is decoding
        ids, usage = collect(engine, request(SYSTEM, scope=BOB, max_tokens=5, no_cache=True))
        assert usage.completion_tokens == len(ids) == 5
        assert all(not handle._job.done.is_set() for handle in flood)
        for handle in flood:
            handle.cancel()
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_simultaneous_requests_on_one_new_prefix_compute_it_once(stack) -> None:
    engine, _ = stack
    rng = random.Random(11)
    system = random_prompt(rng, 160, 160)  # 10 blocks nobody has cached
    suffixes = [random_prompt(rng, 5, 9) for _ in range(8)]
    before = engine.counters
    results = concurrently(engine, [request(system + s, max_tokens=1) for s in suffixes])
    after = engine.counters
    computed = after.num_prefill_tokens - before.num_prefill_tokens
    assert computed <= len(system) + sum(len(s) for s in suffixes) + 8 * 16
    # Computed once either way: the requests that arrived while the prefix was being computed
    # waited for it (counted), the ones that arrived after it was stored found it cached. Which
    # of the two happens depends on thread timing, so both count here.
    waited = after.num_dedup_waits - before.num_dedup_waits
    found_cached = sum(1 for _, u in results if u.cached_tokens >= 160)
    assert waited + found_cached >= 7
    assert sum(u.cached_tokens for _, u in results) >= 7 * 160
    alone = [collect(engine, request(system + s, max_tokens=1, no_cache=True))[0]
             for s in suffixes]
    assert [ids for ids, _ in results] == alone


def test_a_warm_past_its_deadline_stops_and_releases_its_blocks(stack) -> None:
    engine, opened = stack
    warm = WarmRequest(prompt=PromptInput(token_ids=SYSTEM * 3), scope=ALICE,
                       deadline=time.monotonic() - 1)
    with pytest.raises(DeadlineExceeded):
        engine.warm(warm)
    assert opened.cache.total_refcount() == 0


def test_a_cancelled_warm_stops_and_releases_its_blocks(stack) -> None:
    engine, opened = stack
    handle = engine.start_warm(WarmRequest(prompt=PromptInput(token_ids=SYSTEM * 6),
                                           scope=ALICE))
    handle.cancel()
    with pytest.raises(RequestCancelled):
        handle.result()
    assert opened.cache.total_refcount() == 0
