"""The engine over one page pool: a hit reads the device tier's pages in place, a request holds
only what it writes, and a full pool refuses one request, never the step."""

from __future__ import annotations

import threading

import pytest

from gateway.cache.operations.factory import OpenedCache
from gateway.core.errors import QueueFull
from gateway.engine.engine import Engine
from gateway.engine.models.loading import LoadedModel
from tests.gateway.engine.parity import PROMPT_BY_ID, make_engine, run
from tiers.page_pool import PagePool

PROMPT = PROMPT_BY_ID["over-4-blocks"]


def test_the_engine_runs_in_the_device_tiers_pool(engine: Engine, opened: OpenedCache) -> None:
    assert opened.pool is not None
    run(engine, PROMPT)
    assert opened.pool.num_in_use > 0  # the prompt's blocks are pages of it


def test_a_warm_repeat_adds_no_page_to_the_pool(engine: Engine, opened: OpenedCache) -> None:
    cold, _, _ = run(engine, PROMPT)
    pool = opened.pool
    assert pool is not None
    held = pool.num_in_use  # the device tier's: the prompt's and the answer's full blocks
    warm, _, usage = run(engine, PROMPT)
    assert warm == cold and usage.cached_tokens > 0
    assert pool.num_in_use == held  # read in place; its own pages went back when it ended


def test_concurrent_warm_requests_share_the_prefix_pages_and_answer_as_cold(
        engine: Engine, opened: OpenedCache) -> None:
    cold, _, _ = run(engine, PROMPT)
    answers: list[list[int]] = []
    errors: list[BaseException] = []

    def user() -> None:
        try:
            answers.append(run(engine, PROMPT)[0])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=user) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and answers == [cold] * 4


def test_a_pool_too_small_for_a_request_refuses_it_with_resource_exhausted(
        tiny: LoadedModel) -> None:
    pool = PagePool(tiny.layout, page_tokens=16, num_pages=2)
    engine = make_engine(tiny, None, pool=pool)
    try:
        with pytest.raises(QueueFull, match="no KV page was free"):
            run(engine, PROMPT, no_cache=True)
        assert pool.num_in_use == 0  # what it held went back
    finally:
        engine.stop(grace_s=5)
