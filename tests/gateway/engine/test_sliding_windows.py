"""Sliding windows in every attention the engine runs (issue 43, item 2): a query at position p
attends the keys p - window < k <= p only, as transformers' masks have it -- within float
rounding of exact attention over that window, with a row's bits its own however its prompt is
chunked, and keys before the window weighing exactly nothing (junk there changes no bit).

The tiled attention and the paged C kernel run here; the Triton kernel runs in Triton's
interpreter on the CPU (a child process where this one compiles,
tests/gateway/engine/triton_interpreter.py) and compiled on CUDA (marked ``gpu``). torch's flash
kernel takes no window: it refuses one, and the route search never tries it for such a model.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence

import pytest
import torch

from gateway.engine.attention.flash import FlashBlockAttention
from gateway.engine.attention.paged import PagedAttention, paged_kernel_problem
from gateway.engine.attention.tiled import AttentionItem, SequenceAttention, TiledAttention
from gateway.engine.parity.route_search import attention_names
from tests.gateway.engine.triton_interpreter import interpreted

HEADS, KV_HEADS, DIM = 4, 2, 16
LENGTH, WINDOW = 150, 37
TOLERANCE = 2e-6
"""float32 against float64 attention, for outputs of magnitude up to ~2 (as the kernels' own
tests state it)."""
CHUNKS = (0, 5, 6, 70, 71, 149, 150)
"""Odd chunk boundaries: every position attended in one call, then in these pieces."""


def _sequence(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(LENGTH, HEADS, DIM, generator=generator),
            torch.randn(KV_HEADS, LENGTH + 106, DIM, generator=generator),
            torch.randn(KV_HEADS, LENGTH + 106, DIM, generator=generator))


def _reference(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               positions: Sequence[int], window: int) -> torch.Tensor:
    """Attention in float64 over each row's window."""
    rep = queries.shape[1] // keys.shape[0]
    out = []
    for row, position in zip(queries.double(), positions, strict=True):
        lo = max(0, position - window + 1)
        k = keys[:, lo:position + 1].double().repeat_interleave(rep, 0)
        v = values[:, lo:position + 1].double().repeat_interleave(rep, 0)
        weights = torch.softmax(torch.einsum("hd,hkd->hk", row, k) / math.sqrt(row.shape[-1]), -1)
        out.append(torch.einsum("hk,hkd->hd", weights, v))
    return torch.stack(out)


def _attend(attention: SequenceAttention, queries: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor, cuts: Sequence[int], window: int | None) -> torch.Tensor:
    """Every position of the sequence, attended in the pieces between ``cuts``."""
    parts = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        item = AttentionItem.of(queries[start:end], keys, values, torch.arange(start, end),
                                window=window)
        parts.extend(attention.attend([item]))
    return torch.cat(parts)


def _backends() -> list[object]:
    params: list[object] = [pytest.param(TiledAttention(), id="tiled")]
    problem = paged_kernel_problem(torch.device("cpu"), torch.float32, DIM)
    params.append(pytest.param(PagedAttention(), id="paged",
                               marks=pytest.mark.skipif(problem is not None,
                                                        reason=str(problem))))
    return params


@pytest.mark.parametrize("attention", _backends())
def test_a_windowed_row_is_within_float_rounding_of_attention_over_its_window(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(1)
    out = _attend(attention, queries, keys, values, (0, LENGTH), WINDOW)
    expected = _reference(queries, keys, values, range(LENGTH), WINDOW)
    assert float((out.double() - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_a_windowed_prompt_in_odd_chunks_has_the_bits_of_it_one_shot(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(2)
    one_shot = _attend(attention, queries, keys, values, (0, LENGTH), WINDOW)
    assert torch.equal(_attend(attention, queries, keys, values, CHUNKS, WINDOW), one_shot)


@pytest.mark.parametrize("attention", _backends())
def test_keys_before_a_rows_window_change_none_of_its_bits(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(3)
    position = LENGTH - 1
    row = queries[position:position + 1]
    clean = _attend_row(attention, row, keys, values, position)
    junk_keys, junk_values = keys.clone(), values.clone()
    junk_keys[:, :position - WINDOW + 1] = 1e4  # would dominate any softmax that saw them
    junk_values[:, :position - WINDOW + 1] = -1e4
    assert torch.equal(_attend_row(attention, row, junk_keys, junk_values, position), clean)


@pytest.mark.parametrize("attention", _backends())
def test_a_window_wider_than_the_prompt_changes_no_bit(attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(4)
    full = _attend(attention, queries, keys, values, (0, LENGTH), None)
    assert torch.equal(_attend(attention, queries, keys, values, (0, LENGTH), 4 * LENGTH), full)


def _attend_row(attention: SequenceAttention, row: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, position: int) -> torch.Tensor:
    [out] = attention.attend([AttentionItem.of(row, keys, values, torch.tensor([position]),
                                               window=WINDOW)])
    return out


def test_torch_flash_kernel_refuses_a_window() -> None:
    queries, keys, values = _sequence(5)
    item = AttentionItem.of(queries[:4], keys, values, torch.arange(4), window=WINDOW)
    with pytest.raises(ValueError, match="no sliding window"):
        FlashBlockAttention().attend([item])


def test_the_route_search_never_tries_flash_for_a_windowed_model() -> None:
    assert "flash" not in attention_names(torch.device("cpu"), torch.float32, DIM,
                                          windowed=True)


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (`make venv` installs it)")


@needs_triton
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@interpreted
def test_the_triton_kernel_keeps_windows_exactly_and_chunk_for_chunk(device: str) -> None:
    from gateway.engine.attention.triton_paged import TritonPagedAttention

    attention = TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8)
    queries, keys, values = (t.to(device) for t in _sequence(6))
    one_shot = _attend(attention, queries, keys, values, (0, LENGTH), WINDOW)
    expected = _reference(queries.cpu(), keys.cpu(), values.cpu(), range(LENGTH), WINDOW)
    assert float((one_shot.cpu().double() - expected).abs().max()) <= TOLERANCE
    assert torch.equal(_attend(attention, queries, keys, values, CHUNKS, WINDOW), one_shot)
    junk_keys = keys.clone()
    junk_keys[:, :LENGTH - WINDOW] = 1e4
    last = queries[LENGTH - 1:]
    [clean] = attention.attend([AttentionItem.of(last, keys, values,
                                                 torch.tensor([LENGTH - 1], device=device),
                                                 window=WINDOW)])
    [junk] = attention.attend([AttentionItem.of(last, junk_keys, values,
                                                torch.tensor([LENGTH - 1], device=device),
                                                window=WINDOW)])
    assert torch.equal(junk, clean)
