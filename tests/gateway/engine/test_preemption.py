"""Preemption in the step loop (issue 28): a generation preempted for a better-priority request
of its tenant resumes from the K/V it handed to the cache, and its answer and stream are exactly
those of the same request never preempted (greedy, and sampled with a seed), on the tiny Llama.

Each test lets one tenant run one request at a time (``max_running_per_tenant = 1``), so that its
better-priority request can only start by preempting the running one.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, TokenDelta, Usage
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.service.metrics import GatewayMetrics
from tests.gateway.engine.kernels import batched_kernels
from tests.gateway.engine.parity import SECRET, cache_config
from tests.gateway.engine.test_batching import ALICE, BOB, random_prompt, start
from tests.tiny_llama import save_tiny_llama

BLOCK = 16
BULK_PROMPT = random_prompt(random.Random(28), 100, 100)
BULK_MAX_TOKENS = 200
URGENT_PROMPT = random_prompt(random.Random(29), 40, 40)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture
def stack(tiny: LoadedModel, tmp_path: Path) -> Iterator[tuple[Engine, OpenedCache]]:
    engine, opened = start(tiny, tmp_path, BLOCK, max_running_per_tenant=1,
                           max_kv_share_per_tenant=1.0)
    yield engine, opened
    engine.stop(grace_s=5)
    opened.close()


def generation(tokens: list[int], *, priority: int = 0, max_tokens: int = BULK_MAX_TOKENS,
               scope: Scope = ALICE, no_cache: bool = False,
               temperature: float = 0.0) -> GenerateRequest:
    return GenerateRequest(prompt=PromptInput(token_ids=tokens), scope=scope, priority=priority,
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                   seed=1),
                           cache=CacheOptions(no_cache=no_cache))


class Streamed:
    """A generation read on a thread of its own: every delta's tokens as they come, the usage."""

    def __init__(self, engine: Engine, request: GenerateRequest) -> None:
        self.tokens: list[int] = []
        self.usage: Usage | None = None
        self._handle = engine.generate(request)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for event in self._handle:
            if isinstance(event, TokenDelta):
                self.tokens.extend(event.token_ids)
            else:
                self.usage = event

    def wait_for_tokens(self, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.tokens) < count and self.usage is None:
            assert time.monotonic() < deadline, "no tokens within 60 s"
            time.sleep(0.001)

    def result(self) -> tuple[list[int], Usage]:
        self._thread.join(timeout=120)
        assert self.usage is not None, "the generation did not finish"
        return self.tokens, self.usage


def unpreempted(engine: Engine, request: GenerateRequest) -> list[int]:
    tokens, usage = Streamed(engine, request).result()
    assert usage.finish_reason == "length", "the tests need answers long enough to preempt"
    return tokens


def preempted_while_decoding(engine: Engine, bulk: GenerateRequest) -> tuple[list[int], Usage]:
    """``bulk`` run until it has streamed 5 tokens, then preempted by an urgent request of its
    tenant that runs to its end first; ``bulk``'s whole stream and usage."""
    before = engine.counters.num_preemptions
    streamed = Streamed(engine, bulk)
    streamed.wait_for_tokens(5)
    urgent = Streamed(engine, generation(URGENT_PROMPT, priority=-1, max_tokens=3))
    urgent.result()
    result = streamed.result()
    assert engine.counters.num_preemptions == before + 1
    return result


@pytest.mark.parametrize("no_cache", [False, True], ids=["cached", "no_cache"])
def test_a_request_preempted_while_decoding_streams_exactly_its_unpreempted_tokens(
        stack: tuple[Engine, OpenedCache], no_cache: bool) -> None:
    engine, _ = stack
    bulk = generation(BULK_PROMPT, priority=5, no_cache=no_cache)
    expected = unpreempted(engine, bulk)
    tokens, usage = preempted_while_decoding(engine, bulk)
    assert tokens == expected  # nothing repeated, nothing lost, nothing changed
    assert usage.completion_tokens == len(expected)


def test_a_sampled_request_preempted_samples_on_as_it_would_have(
        stack: tuple[Engine, OpenedCache]) -> None:
    engine, _ = stack
    bulk = generation(BULK_PROMPT, priority=5, temperature=0.8)  # seeded
    expected = unpreempted(engine, bulk)
    tokens, _ = preempted_while_decoding(engine, bulk)
    assert tokens == expected


def test_a_preempted_request_resumes_from_its_cached_kv_computing_only_its_last_token(
        stack: tuple[Engine, OpenedCache]) -> None:
    engine, _ = stack
    bulk = generation(BULK_PROMPT, priority=5)
    before = engine.counters.num_prefill_tokens
    tokens, usage = preempted_while_decoding(engine, bulk)
    computed = engine.counters.num_prefill_tokens - before
    # its prompt once, the urgent prompt, and on resuming the last token it generated before
    # (its logits are needed); its blocks and the tail after them came from the cache
    assert computed == len(BULK_PROMPT) + len(URGENT_PROMPT) + 1
    assert usage.cached_tokens == 0  # what it found cached at its first admission


def test_a_request_preempted_while_prefilling_gets_its_unpreempted_answer(
        tiny: LoadedModel, tmp_path: Path) -> None:
    engine, opened = start(tiny, tmp_path, BLOCK, max_running_per_tenant=1, step_tokens=16,
                           prefill_step_tokens=16)
    try:
        long_prompt = random_prompt(random.Random(30), 1_500, 1_500)
        # the reference in another tenant's namespace: alice's prompt is then not cached
        expected = unpreempted(engine, generation(long_prompt, scope=BOB, max_tokens=20))
        before = engine.counters.num_prefill_tokens
        streamed = Streamed(engine, generation(long_prompt, priority=5, max_tokens=20))
        deadline = time.monotonic() + 60
        while engine.counters.num_prefill_tokens == before:  # its prefill has begun
            assert time.monotonic() < deadline
            time.sleep(0.001)
        Streamed(engine, generation(URGENT_PROMPT, priority=-1, max_tokens=3)).result()
        tokens, _ = streamed.result()
        assert engine.counters.num_preemptions == 1
        assert tokens == expected
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_where_decoding_does_not_write_a_prefills_kv_a_better_request_waits_instead(
        tiny: LoadedModel, tmp_path: Path) -> None:
    engine, opened = start(tiny, tmp_path, BLOCK, linear_kernel="blas",
                           max_running_per_tenant=1)
    try:
        assert not engine.route.decode_kv_is_prefill_kv  # a resumed request would differ
        bulk = Streamed(engine, generation(BULK_PROMPT, priority=5, max_tokens=40))
        bulk.wait_for_tokens(5)
        urgent = Streamed(engine, generation(URGENT_PROMPT, priority=-1, max_tokens=3))
        bulk.result()
        urgent.result()
        assert engine.counters.num_preemptions == 0
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_a_tenants_priority_never_preempts_or_holds_back_another_tenants_request(
        stack: tuple[Engine, OpenedCache]) -> None:
    engine, _ = stack
    flood = Streamed(engine, generation(BULK_PROMPT, priority=-1_000))
    flood.wait_for_tokens(1)
    queued = Streamed(engine, generation(URGENT_PROMPT, priority=-1_000))  # waits for alice's
    tokens, usage = Streamed(engine, generation(URGENT_PROMPT, scope=BOB, priority=1_000,
                                                max_tokens=3)).result()
    assert usage.completion_tokens == len(tokens) == 3
    assert flood.usage is None  # bob was answered while alice's request still ran
    assert engine.counters.num_preemptions == 0
    flood.result()
    queued.result()


def test_each_preemption_is_counted_in_the_gateways_metrics(tiny: LoadedModel,
                                                            tmp_path: Path) -> None:
    metrics = GatewayMetrics()
    opened = open_cache(cache_config(tmp_path, block_tokens=BLOCK), layout=tiny.layout,
                        deployment_secret=SECRET)
    engine = Engine(loaded=tiny, cache=opened.cache, pool=opened.pool, metrics=metrics,
                    config=EngineConfig(block_tokens=BLOCK, max_running_per_tenant=1),
                    deployment_secret=SECRET, kernels=batched_kernels(tiny, "auto"))
    engine.start()
    try:
        preempted_while_decoding(engine, generation(BULK_PROMPT, priority=5))
        assert metrics.registry.get_sample_value("kvgate_preemptions_total") == 1
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_a_lossy_request_preempted_resumes_on_the_same_lossy_kv(tiny: LoadedModel,
                                                                 tmp_path: Path) -> None:
    """A request that read lossy copies hands its K/V to the lossy namespace when preempted and
    resumes from there: the same answer as never preempted, still said to be lossy."""
    opened = open_cache(cache_config(tmp_path, block_tokens=BLOCK, quantize={"disk": "int8"}),
                        layout=tiny.layout, deployment_secret=SECRET)
    engine = Engine(loaded=tiny, cache=opened.cache, pool=opened.pool,
                    config=EngineConfig(block_tokens=BLOCK, max_running_per_tenant=1,
                                        max_kv_share_per_tenant=1.0),
                    deployment_secret=SECRET, kernels=batched_kernels(tiny, "auto"))
    engine.start()
    try:
        unpreempted(engine, generation(BULK_PROMPT))  # stores the prompt, and its int8 copies
        opened.cache.evict("device", 1 << 40)
        opened.cache.evict("host", 1 << 40)
        opened.hierarchy.flush(timeout_s=30.0)
        bulk = GenerateRequest(prompt=PromptInput(token_ids=BULK_PROMPT), scope=ALICE,
                               priority=5, sampling=SamplingParams(max_tokens=BULK_MAX_TOKENS),
                               cache=CacheOptions(allow_lossy=True))
        expected, first = Streamed(engine, bulk).result()
        assert first.lossy and "disk:int8" in first.cached_tokens_by_tier
        tokens, usage = preempted_while_decoding(engine, bulk)
        assert tokens == expected
        assert usage.lossy
    finally:
        engine.stop(grace_s=5)
        opened.close()
