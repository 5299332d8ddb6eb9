"""A request's failure is its own (issue 22): whatever one request carries, the others in the
step are served what they are served alone.

The review sent ``temperature = 1e-45`` beside other tenants' streams: softmax gave NaN,
``torch.multinomial`` raised, and the step loop ended every request in flight. Here the other
tenants' greedy requests are decoding when the edge (or failing) request arrives, and their
answers are compared, token for token, with the same requests run alone.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import gateway.engine.scheduling.loop as loop_module
from gateway.cache.operations.factory import OpenedCache
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import (
    MIN_SAMPLING_TEMPERATURE,
    CacheOptions,
    GenerateRequest,
    SamplingParams,
    TokenDelta,
    Usage,
)
from gateway.engine.engine import Engine
from gateway.engine.output.detokenizer import Detokenizer
from gateway.engine.output.sampling import Sampler
from gateway.engine.scheduling.jobs import RequestHandle
from gateway.engine.scheduling.loop_records import ActiveRequest
from gateway.engine.scheduling.request_blocks import RequestBlocks

ALICE = Scope.of_tenant("alice")
OTHERS = [Scope.of_tenant("bob"), Scope.of_tenant("carol"), Scope.of_tenant("dave")]
VICTIM_STOP = "\x07victim\x07"
"""A stop string the tiny model never writes: it marks the request whose seam fails."""

EDGE_SAMPLING: list[dict[str, Any]] = [
    {"temperature": 1e-45},
    {"temperature": 1e-38},
    {"temperature": 1e-40},  # a float32 denormal
    {"temperature": 5e-324},  # a float64 denormal
    {"temperature": MIN_SAMPLING_TEMPERATURE},
    {"temperature": 1e-4},
    {"temperature": 10.0, "seed": 2**63 - 1},
    {"temperature": 1.0, "top_p": 5e-324, "seed": 0},
    {"temperature": 1.0, "top_p": 1e-46},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 10.0, "top_k": 2**62},
    {"temperature": 1e-45, "top_p": 1e-300, "top_k": 2**62},
    {"stop": tuple(chr(0x41 + i) * 256 for i in range(16))},
    {"stop": ("\ufffd", "\ud800")},
]


def _request(tokens: list[int], scope: Scope, *, max_tokens: int,
             **sampling: Any) -> GenerateRequest:
    return GenerateRequest(prompt=PromptInput(token_ids=tokens), scope=scope,
                           sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                           cache=CacheOptions(no_cache=scope != ALICE))


def _drain(events: Iterator[TokenDelta | Usage]) -> tuple[list[int], Usage]:
    ids: list[int] = []
    for event in events:
        if isinstance(event, Usage):
            return ids, event
        ids.extend(event.token_ids)
    raise AssertionError("the stream ended without a Usage")


Outcome = tuple[list[int], Usage] | BaseException


def _outcome(handle: RequestHandle) -> Outcome:
    try:
        return _drain(iter(handle))
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return exc


def _other_tenants_requests() -> list[GenerateRequest]:
    rng = random.Random(22)
    return [_request([rng.randrange(400) for _ in range(rng.randint(20, 60))], scope,
                     max_tokens=40) for scope in OTHERS]


def _beside_decoding_others(engine: Engine, others: list[GenerateRequest],
                            extra: list[GenerateRequest]
                            ) -> tuple[list[list[int]], list[Outcome]]:
    """Start ``others`` and wait until each has its first token (all are decoding), then
    submit ``extra``; the others' whole answers, and each extra request's outcome."""
    streams = [iter(engine.generate(r)) for r in others]
    firsts: list[list[int]] = []
    for stream in streams:
        first = next(stream)
        assert isinstance(first, TokenDelta)
        firsts.append(list(first.token_ids))
    handles = [engine.generate(r) for r in extra]
    extras = [_outcome(h) for h in handles]
    answers = [first + _drain(stream)[0] for first, stream in zip(firsts, streams, strict=True)]
    return answers, extras


def test_every_edge_sampling_value_is_served_and_others_answers_are_unchanged(
        engine: Engine, opened: OpenedCache) -> None:
    others = _other_tenants_requests()
    alone = [_drain(iter(engine.generate(r)))[0] for r in others]
    prompt = [(7 * i + 1) % 400 for i in range(40)]
    edges = [_request(prompt, ALICE, max_tokens=6, **fields) for fields in EDGE_SAMPLING]
    answers, outcomes = _beside_decoding_others(engine, others, edges)
    assert answers == alone
    failed = {repr(fields): outcome for fields, outcome in zip(EDGE_SAMPLING, outcomes,
                                                                strict=True)
              if isinstance(outcome, BaseException)}
    assert not failed, failed
    assert opened.cache.total_refcount() == 0


def test_a_temperature_below_the_minimum_answers_as_greedy(engine: Engine) -> None:
    prompt = [(11 * i + 5) % 400 for i in range(30)]
    greedy = _drain(iter(engine.generate(_request(prompt, OTHERS[0], max_tokens=12))))[0]
    for temperature in (1e-45, 5e-324, 9e-6):
        tiny_t = _request(prompt, OTHERS[0], max_tokens=12, temperature=temperature)
        assert _drain(iter(engine.generate(tiny_t)))[0] == greedy, temperature


class _FailingSampler(Sampler):
    def pick(self, logits: torch.Tensor) -> int:
        if VICTIM_STOP in self.params.stop:
            raise RuntimeError("injected: the victim's sampler fails")
        return super().pick(logits)


class _FailingDetokenizer(Detokenizer):
    def add(self, token_id: int) -> str:
        if VICTIM_STOP in self._stop and len(self.token_ids) == 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected: the victim's 3rd token")
        return super().add(token_id)


def _failing_store(real: Any) -> Any:
    def store_prompt_blocks(self: RequestBlocks, active: ActiveRequest) -> None:
        request = active.job.request
        assert isinstance(request, GenerateRequest)
        if VICTIM_STOP in request.sampling.stop:
            raise OSError("injected: storing the victim's prompt blocks fails")
        real(self, active)
    return store_prompt_blocks


def _inject(monkeypatch: pytest.MonkeyPatch, seam: str) -> None:
    if seam == "sampling":
        monkeypatch.setattr(loop_module, "Sampler", _FailingSampler)
    elif seam == "detokenizing":
        monkeypatch.setattr(loop_module, "Detokenizer", _FailingDetokenizer)
    else:
        monkeypatch.setattr(RequestBlocks, "store_prompt_blocks",
                            _failing_store(RequestBlocks.store_prompt_blocks))


@pytest.mark.parametrize("seam", ["sampling", "detokenizing", "storing its prompt blocks"])
def test_a_failure_after_the_forward_fails_only_its_own_request(
        engine: Engine, opened: OpenedCache, monkeypatch: pytest.MonkeyPatch, seam: str) -> None:
    others = _other_tenants_requests()
    alone = [_drain(iter(engine.generate(r)))[0] for r in others]
    _inject(monkeypatch, seam)
    victim = _request([(3 * i + 2) % 400 for i in range(40)], ALICE, max_tokens=20,
                      stop=(VICTIM_STOP,))
    answers, [outcome] = _beside_decoding_others(engine, others, [victim])
    assert isinstance(outcome, RuntimeError)
    assert str(outcome).startswith("internal error handling this request's output")
    assert answers == alone
    assert opened.cache.total_refcount() == 0
    monkeypatch.undo()
    after = [_drain(iter(engine.generate(r)))[0] for r in others]  # the engine serves on
    assert after == alone
