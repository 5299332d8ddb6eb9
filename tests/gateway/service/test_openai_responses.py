"""The engine's usage as OpenAI response objects: the ``kvgate`` object's ``exact`` (no server).

An engine that answers lossy (``Usage.lossy``) is not wired yet (docs/design.md, "Lossy tiers"),
so what the HTTP front writes for such an answer is checked here on the record it will get; the
exact side, and the request option, are checked through the real front in
``test_openai_http.py``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.core.requests import Usage
from gateway.service.http.openai_responses import DONE_EVENT, Rendering, usage_object

EXACT = Usage(prompt_tokens=342, cached_tokens=320, cached_tokens_by_tier={"device": 320},
              completion_tokens=48, ttft_ms=185.5, total_ms=1701.7, finish_reason="length")
LOSSY = Usage(prompt_tokens=2100, cached_tokens=2048,
              cached_tokens_by_tier={"disk:int8": 1920, "device": 128}, completion_tokens=8,
              ttft_ms=40.25, total_ms=90.5, finish_reason="eos", lossy=True)


def _events(lines: list[str]) -> list[Any]:
    """The JSON payloads of server-sent events (``[DONE]`` left out)."""
    return [json.loads(line.removeprefix("data: ")) for line in lines if line != DONE_EVENT]


def test_an_exact_answers_kvgate_object_says_exact_true() -> None:
    assert usage_object(EXACT)["kvgate"] == {
        "cached_tokens_by_tier": {"device": 320}, "ttft_ms": 185.5, "total_ms": 1701.7,
        "finish_reason": "length", "exact": True}


def test_a_lossy_answer_says_exact_false_and_names_its_tiers_with_their_format() -> None:
    usage = usage_object(LOSSY)
    assert usage["kvgate"] == {
        "cached_tokens_by_tier": {"device": 128, "disk:int8": 1920}, "ttft_ms": 40.25,
        "total_ms": 90.5, "finish_reason": "eos", "exact": False}
    assert usage["prompt_tokens_details"] == {"cached_tokens": 2048}


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_whole_answer_carries_exact_in_its_usage(kind: Any) -> None:
    rendering = Rendering(kind=kind, model="m")
    lossy = json.loads(json.dumps(rendering.completion("text", LOSSY)))
    exact = json.loads(json.dumps(rendering.completion("text", EXACT)))
    assert lossy["usage"]["kvgate"]["exact"] is False
    assert exact["usage"]["kvgate"]["exact"] is True


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_streams_usage_chunk_carries_exact(kind: Any) -> None:
    rendering = Rendering(kind=kind, model="m", include_usage=True)
    lossy = _events(rendering.closing(LOSSY))
    exact = _events(rendering.closing(EXACT))
    assert lossy[-1]["choices"] == [] and lossy[-1]["usage"]["kvgate"]["exact"] is False
    assert exact[-1]["usage"]["kvgate"]["exact"] is True
    assert lossy[-1]["usage"]["kvgate"]["cached_tokens_by_tier"] == {
        "device": 128, "disk:int8": 1920}
