"""The sampler (``gateway.engine.output.sampling``): greedy is argmax, and every value validation
accepts gives a token, never NaN probabilities (issue 22: ``temperature = 1e-45`` made softmax NaN
and
``torch.multinomial`` raised)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gateway.core.requests import MIN_SAMPLING_TEMPERATURE, SamplingParams
from gateway.engine.output.sampling import Sampler

VOCAB = 64
FLOAT32_MAX = torch.finfo(torch.float32).max

EDGE_PARAMS: list[dict[str, Any]] = [
    {"temperature": 5e-324},
    {"temperature": 1e-45},
    {"temperature": 1e-40},  # a float32 denormal
    {"temperature": 1e-38},
    {"temperature": MIN_SAMPLING_TEMPERATURE},
    {"temperature": 1e-4},
    {"temperature": 10.0},
    {"temperature": 1.0, "top_p": 5e-324},
    {"temperature": 1.0, "top_p": 1e-46},
    {"temperature": 1.0, "top_p": 1e-300},
    {"temperature": MIN_SAMPLING_TEMPERATURE, "top_p": 5e-324, "top_k": 1},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 10.0, "top_k": 2**62},
    {"temperature": 1.0, "seed": 0},
    {"temperature": 1.0, "seed": 2**63 - 1},
]


def _logits(kind: str) -> torch.Tensor:
    """Logits a model may give: ordinary, tied at the top, huge, or with masked (-inf) ids."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=generator) * 5
    if kind == "tied":
        logits[[3, 9]] = logits.max() + 1
    elif kind == "huge":
        logits = logits.sign() * FLOAT32_MAX / (1 + logits.abs())
    elif kind == "masked":
        logits[::2] = -math.inf
    return logits


def _params(fields: dict[str, Any]) -> SamplingParams:
    params = SamplingParams(**fields)
    assert params.problems() == []
    return params


@pytest.mark.parametrize("kind", ["ordinary", "tied", "huge", "masked"])
def test_greedy_is_the_argmax_of_the_logits(kind: str) -> None:
    logits = _logits(kind)
    assert Sampler(SamplingParams(), vocab_size=VOCAB).pick(logits) == int(torch.argmax(logits))


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-40, 1e-38,
                                         math.nextafter(MIN_SAMPLING_TEMPERATURE, 0.0)])
def test_a_temperature_below_the_minimum_picks_the_argmax(temperature: float) -> None:
    logits = torch.zeros(VOCAB)
    logits[7] = 1e-6  # a sampler at this temperature would pick id 6 or 8 about half the time
    for seed in range(20):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=seed), vocab_size=VOCAB)
        assert sampler.pick(logits) == 7


@pytest.mark.parametrize("kind", ["ordinary", "tied", "huge", "masked"])
@pytest.mark.parametrize("fields", EDGE_PARAMS, ids=repr)
def test_every_accepted_value_samples_a_token_the_logits_allow(fields: dict[str, Any],
                                                               kind: str) -> None:
    logits = _logits(kind)
    sampler = Sampler(_params({**fields, "seed": fields.get("seed", 1)}), vocab_size=VOCAB)
    for _ in range(5):
        token = sampler.pick(logits)
        assert 0 <= token < VOCAB and logits[token] > -math.inf


@pytest.mark.parametrize("top_p", [5e-324, 1e-46, 1e-300])
def test_a_top_p_below_float32s_smallest_number_keeps_the_most_likely_token(top_p: float
                                                                          ) -> None:
    logits = _logits("ordinary")
    sampler = Sampler(_params({"temperature": 1.0, "top_p": top_p, "seed": 3}),
                      vocab_size=VOCAB)
    assert sampler.pick(logits) == int(torch.argmax(logits))


def test_a_temperature_near_the_minimum_does_not_overflow_huge_logits() -> None:
    logits = _logits("huge")  # logits / 1e-5 would overflow float32: softmax would give NaN
    sampler = Sampler(_params({"temperature": MIN_SAMPLING_TEMPERATURE, "seed": 3}),
                      vocab_size=VOCAB)
    assert sampler.pick(logits) == int(torch.argmax(logits))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_logits_that_are_not_finite_give_their_argmax_instead_of_a_distribution(bad: float
                                                                                ) -> None:
    logits = _logits("ordinary")
    logits[11] = bad
    sampler = Sampler(_params({"temperature": 1.0, "seed": 3}), vocab_size=VOCAB)
    assert sampler.pick(logits) == int(torch.argmax(logits)) == 11


def test_ids_past_the_tokenizers_vocabulary_are_never_picked() -> None:
    logits = torch.zeros(VOCAB + 8)
    logits[VOCAB:] = 100.0
    for fields in ({}, {"temperature": 1.0, "seed": 5}):
        assert Sampler(_params(fields), vocab_size=VOCAB).pick(logits) < VOCAB
