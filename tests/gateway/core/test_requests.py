"""What ``SamplingParams`` accepts, refuses and computes as greedy (``gateway.core.requests``).

Everything ``problems()`` accepts must be computable by the sampler (issue 22: a temperature of
1e-45 was accepted and then made NaN of the logits); the sampler's side is
``tests/gateway/engine/test_sampling.py``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.core.requests import MIN_SAMPLING_TEMPERATURE, SamplingParams

FLOAT32_DENORMAL = 1e-40
SMALLEST_DOUBLE = 5e-324


@pytest.mark.parametrize("temperature", [0.0, SMALLEST_DOUBLE, 1e-45, FLOAT32_DENORMAL, 1e-38,
                                         MIN_SAMPLING_TEMPERATURE, 1.0, 10.0])
def test_every_temperature_from_0_to_10_is_accepted(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).problems() == []


@pytest.mark.parametrize("temperature", [0.0, SMALLEST_DOUBLE, 1e-45, FLOAT32_DENORMAL, 1e-38,
                                         math.nextafter(MIN_SAMPLING_TEMPERATURE, 0.0)])
def test_a_temperature_below_the_minimum_is_greedy(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).is_greedy


@pytest.mark.parametrize("temperature", [MIN_SAMPLING_TEMPERATURE, 0.5, 10.0])
def test_a_temperature_from_the_minimum_up_samples(temperature: float) -> None:
    assert not SamplingParams(temperature=temperature).is_greedy


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -math.inf, -SMALLEST_DOUBLE,
                                         -1.0, math.nextafter(10.0, math.inf)])
def test_a_temperature_outside_0_to_10_is_refused_naming_it(temperature: float) -> None:
    [problem] = SamplingParams(temperature=temperature).problems()
    assert problem.startswith("temperature must be between 0 and 10")


@pytest.mark.parametrize("fields", [
    {"top_p": SMALLEST_DOUBLE},
    {"top_p": 1e-46},
    {"top_p": 1.0},
    {"top_k": 1},
    {"top_k": 2**62},
    {"seed": 0},
    {"seed": 2**63 - 1},
    {"stop": tuple(chr(0x41 + i) * 256 for i in range(16))},
    {"stop": ("\ufffd", "\ud800")},
    {"max_tokens": 1},
], ids=lambda fields: repr(fields)[:40])
def test_the_edges_of_top_p_top_k_seed_and_stop_are_accepted(fields: dict[str, Any]) -> None:
    assert SamplingParams(temperature=1.0, **fields).problems() == []


@pytest.mark.parametrize(("fields", "field"), [
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": -SMALLEST_DOUBLE}, "top_p"),
    ({"top_p": math.nextafter(1.0, 2.0)}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"stop": ("",)}, "stop"),
    ({"stop": ("x" * 257,)}, "stop"),
    ({"stop": ("x",) * 17}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
], ids=lambda fields: repr(fields)[:40])
def test_values_past_the_edges_are_refused_naming_the_field(fields: dict[str, Any],
                                                           field: str) -> None:
    [problem] = SamplingParams(temperature=1.0, **fields).problems()
    assert problem.startswith(field)
