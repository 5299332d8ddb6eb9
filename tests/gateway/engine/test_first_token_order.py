"""A generation's first token is not held back by storing its prompt's blocks, and its answer
does not end before they are stored (``StepLoop._prompt_done``).

Storing a long prompt -- placement, demotions out of a full device tier, queued writes -- is
bookkeeping the client should not wait for (on an H100 an 8B model's recomputed 8k-token prompt,
stored, reached its first token at 1.12x the time of the same prompt with ``no_cache``, likely
mostly this). The store still happens in the same turn, before any other request is admitted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from gateway.cache.operations.factory import OpenedCache
from gateway.core.canonical import PromptInput
from gateway.core.requests import (
    CacheOptions,
    GenerateRequest,
    LookupRequest,
    SamplingParams,
    TokenDelta,
    Usage,
)
from gateway.engine.engine import Engine
from gateway.engine.scheduling.jobs import RequestHandle
from tests.gateway.engine.parity import ALICE, BLOCK

PROMPT = PromptInput(token_ids=[(7 * i) % 400 for i in range(4 * BLOCK + 3)])


def held_insert(opened: OpenedCache, monkeypatch: pytest.MonkeyPatch,
                released: threading.Event) -> list[bool]:
    """Make the cache's ``insert`` wait (up to 10 s) for ``released``; each call records
    whether it was released in time."""
    insert: Callable[..., Any] = opened.cache.insert
    waited: list[bool] = []

    def waiting_insert(*args: Any, **kwargs: Any) -> Any:
        waited.append(released.wait(timeout=10.0))
        return insert(*args, **kwargs)

    monkeypatch.setattr(opened.cache, "insert", waiting_insert)
    return waited


def generate(engine: Engine, max_tokens: int) -> RequestHandle:
    return engine.generate(GenerateRequest(
        prompt=PROMPT, scope=ALICE, sampling=SamplingParams(max_tokens=max_tokens),
        cache=CacheOptions()))


def test_the_first_token_reaches_the_client_before_the_prompt_blocks_are_stored(
        engine: Engine, opened: OpenedCache, monkeypatch: pytest.MonkeyPatch) -> None:
    released = threading.Event()
    waited = held_insert(opened, monkeypatch, released)
    events = iter(generate(engine, max_tokens=4))
    first = next(events)  # arrives while the store is held
    released.set()
    rest = list(events)
    assert isinstance(first, TokenDelta) and first.token_ids
    assert waited and waited[0], "the prompt's blocks were stored before the first token went out"
    assert isinstance(rest[-1], Usage) and rest[-1].completion_tokens == 4


def test_an_answer_of_one_token_ends_only_once_its_prompt_blocks_are_stored(
        engine: Engine, opened: OpenedCache) -> None:
    events = list(generate(engine, max_tokens=1))
    usage = events[-1]
    assert isinstance(usage, Usage) and usage.completion_tokens == 1
    # A client holding the final message finds the prompt cached.
    lookup = engine.lookup(LookupRequest(prompt=PROMPT, scope=ALICE))
    assert lookup.cached_tokens == (4 * BLOCK + 3) // BLOCK * BLOCK
