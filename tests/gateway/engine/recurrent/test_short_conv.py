"""The short causal convolution (``gateway.engine.forward.recurrent.short_conv``): the same bits
however a sequence's tokens arrive, its window all it keeps, and ``conv1d``'s numbers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.forward.recurrent.short_conv import ConvWindow, causal_conv, causal_conv_rows

CHANNELS = 12


def case(n: int, kernel: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, CHANNELS, generator=g), torch.randn(CHANNELS, kernel, generator=g),
            torch.randn(CHANNELS, generator=g))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 30), st.integers(1, 5), st.integers(0, 2**16), st.data())
def test_steps_of_any_size_give_the_bits_of_one_prompt(n: int, kernel: int, seed: int,
                                                       data: st.DataObject) -> None:
    rows, weight, bias = case(n, kernel, seed)
    whole, whole_window = causal_conv(ConvWindow.empty(kernel, CHANNELS), rows, weight, bias)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=n)) if n > 1 else []))
    window, parts = ConvWindow.empty(kernel, CHANNELS), []
    for a, b in zip([0, *cuts], [*cuts, n], strict=True):
        out, window = causal_conv(window, rows[a:b], weight, bias)
        parts.append(out)
    assert torch.equal(torch.cat(parts), whole)
    assert torch.equal(window.inputs, whole_window.inputs)


def test_the_window_is_the_last_inputs_with_zeros_before_the_first() -> None:
    rows, weight, _ = case(2, 4, seed=1)
    _, window = causal_conv(ConvWindow.empty(4, CHANNELS), rows, weight)
    assert torch.equal(window.inputs, torch.cat([torch.zeros(1, CHANNELS), rows]))


def test_it_computes_what_a_depthwise_conv1d_computes() -> None:
    rows, weight, bias = case(17, 4, seed=2)
    ours, _ = causal_conv(ConvWindow.empty(4, CHANNELS), rows, weight, bias)
    theirs = F.conv1d(rows.T.unsqueeze(0), weight.unsqueeze(1), bias, padding=3,
                      groups=CHANNELS)[0, :, :17].T
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)


def test_a_window_of_the_wrong_length_is_refused() -> None:
    rows, weight, _ = case(1, 4, seed=3)
    try:
        causal_conv(ConvWindow.empty(3, CHANNELS), rows, weight)
    except ValueError as exc:
        assert str(exc) == "a kernel of 4 taps needs a window of 3 inputs, got 2"
    else:
        raise AssertionError("a short window was used")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(1, 5),
       st.integers(0, 2**16))
def test_one_row_for_each_of_several_windows_at_once_gives_each_the_bits_of_its_own(
        seen: list[int], kernel: int, seed: int) -> None:
    _, weight, bias = case(1, kernel, seed)
    windows = []
    for i, count in enumerate(seen):
        window = ConvWindow.empty(kernel, CHANNELS)
        if count:
            _, window = causal_conv(window, case(count, kernel, seed + i + 1)[0], weight, bias)
        windows.append(window)
    rows = case(len(seen), kernel, seed + 99)[0]
    together, after = causal_conv_rows(windows, rows, weight, bias)
    for i, window in enumerate(windows):
        alone, alone_window = causal_conv(window, rows[i:i + 1], weight, bias)
        assert torch.equal(together[i:i + 1], alone)
        assert torch.equal(after[i].inputs, alone_window.inputs)
