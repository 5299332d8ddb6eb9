"""The engine's recompute yardstick is the marginal cost of a token, not a step's average."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gateway.engine.parity.prefill_speed import WINDOW, PrefillSpeed, StepTimer


def test_no_step_yet_gives_no_figure() -> None:
    assert PrefillSpeed().s_per_token is None


@given(fixed_s=st.floats(0.0, 0.05), per_token_s=st.floats(1e-6, 1e-3),
       step_tokens=st.integers(1, 8192),
       sizes=st.lists(st.integers(1, 8192), min_size=2, max_size=WINDOW))
def test_an_affine_cost_gives_its_per_token_part_and_its_fixed_part_over_a_full_step(
        fixed_s: float, per_token_s: float, step_tokens: int, sizes: list[int]) -> None:
    speed = PrefillSpeed(step_tokens=step_tokens)
    for n in sizes:
        speed.record(n, fixed_s + per_token_s * n)
    got = speed.s_per_token
    assert got is not None
    mean = sum(sizes) / len(sizes)
    spread = math.sqrt(sum((n - mean) ** 2 for n in sizes) / len(sizes))
    bound = fixed_s / max(sizes) + per_token_s  # the largest step's average
    if spread >= 0.25 * mean:
        want = min(per_token_s + fixed_s / step_tokens, bound)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    else:  # too alike to tell the parts apart: the largest step's average, an upper bound
        assert got == pytest.approx(bound, rel=1e-9)


def test_suffix_steps_heavy_with_fixed_cost_do_not_inflate_the_figure() -> None:
    # The GPU's shape: an 8k cold step at 40 us a token, 40-token suffixes at ~1 ms a token.
    speed = PrefillSpeed(step_tokens=8192)
    speed.record(8192, 0.030 + 8192 * 40e-6)
    for _ in range(20):
        speed.record(40, 0.030 + 40 * 40e-6)
    assert speed.s_per_token == pytest.approx(40e-6 + 0.030 / 8192, rel=1e-6)


def test_a_slope_noise_made_negative_falls_back_to_the_largest_steps_average() -> None:
    speed = PrefillSpeed()
    speed.record(100, 0.5)
    speed.record(1000, 0.2)
    assert speed.s_per_token == pytest.approx(0.2 / 1000)


def test_only_the_latest_window_of_steps_counts() -> None:
    speed = PrefillSpeed(window=4)
    for _ in range(4):
        speed.record(1000, 10.0)
    for n in (100, 400, 700, 1000):
        speed.record(n, 1e-3 * n)
    assert speed.num_samples == 4
    assert speed.s_per_token == pytest.approx(1e-3)  # no fixed part in these four


def test_empty_or_instant_steps_are_not_samples() -> None:
    speed = PrefillSpeed()
    speed.record(0, 1.0)
    speed.record(10, 0.0)
    assert speed.num_samples == 0


def test_a_window_under_two_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        PrefillSpeed(window=1)


def test_a_full_step_of_no_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="step_tokens"):
        PrefillSpeed(step_tokens=0)


def test_the_cpu_timer_records_each_step_it_wraps() -> None:
    timer = StepTimer(torch.device("cpu"))
    with timer.step(64):
        torch.ones(256, 256) @ torch.ones(256, 256)
    assert timer.speed.num_samples == 1
    assert timer.s_per_token is not None and timer.s_per_token > 0


def test_a_step_that_raises_is_not_timed() -> None:
    timer = StepTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError), timer.step(64):
        raise RuntimeError("forward failed")
    assert timer.speed.num_samples == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_timer_reads_gpu_time_once_the_gpu_is_done() -> None:
    timer = StepTimer(torch.device("cuda"))
    a = torch.ones(4096, 4096, device="cuda")
    with timer.step(4096):
        for _ in range(8):
            a = a @ a / 4096
    torch.cuda.synchronize()
    assert timer.s_per_token is not None
    assert timer.speed.num_samples == 1
