"""Many long prompts at once against a small KV budget: each is answered or refused with
RESOURCE_EXHAUSTED naming the limit, and the engine serves on (the CPU form of issue 14's "64
users sending 8k-token prompts at once").
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from gateway.core.errors import QueueFull
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.test_batching import collect, random_prompt, request, start
from tests.tiny_llama import save_tiny_llama

NUM_USERS = 24
PROMPT_TOKENS = 600
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def flood(tiny: LoadedModel, tmp_path: Path, **config: object
          ) -> tuple[list[list[int]], list[BaseException], list[int]]:
    """NUM_USERS long prompts at once; their answers, their errors, and one request's answer
    after the flood."""
    one_request = KVSequence.nbytes_for(tiny.layout, PROMPT_TOKENS + MAX_TOKENS, page_tokens=16)
    engine, opened = start(tiny, tmp_path, 16, kv_budget_bytes=3 * one_request,
                           max_kv_share_per_tenant=1.0, **config)  # one tenant: the whole budget
    rng = random.Random(5)
    prompts = [random_prompt(rng, PROMPT_TOKENS, PROMPT_TOKENS) for _ in range(NUM_USERS)]
    answers: list[list[int]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(NUM_USERS)

    def user(prompt: list[int]) -> None:
        barrier.wait()
        try:
            answers.append(collect(engine, request(prompt, max_tokens=MAX_TOKENS,
                                                   no_cache=True))[0])
        except BaseException as exc:  # noqa: BLE001 - judged by the test
            errors.append(exc)

    try:
        threads = [threading.Thread(target=user, args=(p,)) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        assert engine.counters.max_sequences_in_step <= 3  # the budget held
        after = collect(engine, request(prompts[0], max_tokens=MAX_TOKENS, no_cache=True))[0]
    finally:
        engine.stop(grace_s=5)
        opened.close()
    return answers, errors, after


def test_requests_beyond_the_kv_budget_wait_and_are_all_answered(tiny: LoadedModel,
                                                                 tmp_path: Path) -> None:
    answers, errors, after = flood(tiny, tmp_path, max_queue=NUM_USERS,
                                   max_queued_per_tenant=NUM_USERS)
    assert not errors, errors
    assert len(answers) == NUM_USERS
    assert after in answers  # the same prompt, the same greedy answer


def test_requests_beyond_the_queue_are_refused_naming_it_and_the_rest_answered(
        tiny: LoadedModel, tmp_path: Path) -> None:
    answers, errors, _ = flood(tiny, tmp_path, max_queue=8, max_queued_per_tenant=NUM_USERS)
    assert errors and all(isinstance(e, QueueFull) and "max_queued" in str(e) for e in errors)
    assert len(answers) + len(errors) == NUM_USERS
