"""One tenant's long generations cannot hold the whole KV budget (issue 22, HIGH): another
tenant's small request is answered while they run, and the first tenant's excess waits behind
its own."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.test_batching import BOB, SYSTEM, collect, random_prompt, request, start
from tests.tiny_llama import save_tiny_llama

FLOOD_PROMPT_TOKENS = 150
FLOOD_MAX_TOKENS = 400


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def test_another_tenant_is_answered_while_one_holds_its_kv_share_with_long_generations(
        tiny: LoadedModel, tmp_path: Path) -> None:
    one_flood = KVSequence.nbytes_for(tiny.layout, FLOOD_PROMPT_TOKENS + FLOOD_MAX_TOKENS,
                                      page_tokens=16)
    engine, opened = start(tiny, tmp_path, 16, kv_budget_bytes=4 * one_flood)
    try:
        rng = random.Random(22)
        flood = [engine.generate(request(random_prompt(rng, FLOOD_PROMPT_TOKENS,
                                                       FLOOD_PROMPT_TOKENS),
                                         max_tokens=FLOOD_MAX_TOKENS, no_cache=True))
                 for _ in range(4)]  # would fill the whole budget
        next(iter(flood[0]))  # the flood decodes
        ids, usage = collect(engine, request(SYSTEM, scope=BOB, max_tokens=5, no_cache=True))
        assert usage.completion_tokens == len(ids) == 5
        assert not any(handle._job.done.is_set() for handle in flood)
        assert engine.counters.max_sequences_in_step <= 3  # two of the flood's, and bob's
        for handle in flood:
            handle.cancel()
    finally:
        engine.stop(grace_s=5)
        opened.close()
