"""Attention sinks (gpt-oss's ``self_attn.sinks``) in every attention the engine runs: one
learned logit per query head joins each row's softmax denominator as a key with no value.
Within float rounding of a plain softmax with that extra column, with and without a sliding
window, with sinks that dominate every score; a row's bits its own however its prompt is chunked
and whatever other sequences share the call; no bit changed for a model without sinks.

The tiled attention and the paged C kernel run here; the Triton kernel in Triton's interpreter
on the CPU (tests/gateway/engine/triton_interpreter.py) and compiled on CUDA (marked ``gpu``).
torch's flash kernel has no column for a sink: it refuses them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from gateway.engine.attention.flash import FlashBlockAttention
from gateway.engine.attention.tiled import AttentionItem, SequenceAttention
from tests.gateway.engine.test_sliding_windows import (
    CHUNKS,
    HEADS,
    LENGTH,
    TOLERANCE,
    WINDOW,
    _attend,
    _backends,
    _sequence,
    needs_triton,
)
from tests.gateway.engine.triton_interpreter import interpreted

SINKS = torch.tensor([0.7, -1.3, 2.1, 0.0])
"""One per query head: above, below and at the scores' usual range."""
DOMINANT_SINKS = torch.full((HEADS,), 30.0)
"""Far above every score: the maximum a row's weights are taken from is its sink's."""


def _reference(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               positions: Sequence[int], sinks: torch.Tensor,
               window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention in float64 with each head's sink one more column of its softmax, whose
    probability is dropped (it has no value); with ``softcap``, the scores (not the sink)
    capped first."""
    rep = queries.shape[1] // keys.shape[0]
    out = []
    for row, position in zip(queries.double(), positions, strict=True):
        lo = 0 if window is None else max(0, position - window + 1)
        k = keys[:, lo:position + 1].double().repeat_interleave(rep, 0)
        v = values[:, lo:position + 1].double().repeat_interleave(rep, 0)
        scores = torch.einsum("hd,hkd->hk", row, k) / math.sqrt(row.shape[-1])
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        columns = torch.cat([scores, sinks.double()[:, None]], dim=-1)
        weights = torch.softmax(columns, dim=-1)[:, :-1]
        out.append(torch.einsum("hk,hkd->hd", weights, v))
    return torch.stack(out)


def _attend_sunk(attention: SequenceAttention, queries: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, cuts: Sequence[int], sinks: torch.Tensor,
                 window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Every position of the sequence with ``sinks``, attended in the pieces between ``cuts``."""
    parts = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        positions = torch.arange(start, end, device=queries.device)
        parts.extend(attention.attend([AttentionItem.of(queries[start:end], keys, values,
                                                        positions, window=window,
                                                        softcap=softcap, sinks=sinks)]))
    return torch.cat(parts)


def _beside_others(attention: SequenceAttention, device: str = "cpu") -> None:
    """The last rows of one sequence alone, then in one call with other sequences' rows (a
    long chunk and decode-sized ones): the same bits."""
    sinks = SINKS.to(device)
    sequences = [[t.to(device) for t in _sequence(seed)] for seed in (31, 32, 33)]
    queries, keys, values = sequences[0]
    last = LENGTH - 3
    mine = AttentionItem.of(queries[last:], keys, values,
                            torch.arange(last, LENGTH, device=device), sinks=sinks)
    [alone] = attention.attend([mine])
    others = [AttentionItem.of(q[:90], k, v, torch.arange(90, device=device), sinks=sinks)
              for q, k, v in sequences[1:2]]
    others += [AttentionItem.of(q[40:43], k, v, torch.arange(40, 43, device=device),
                                sinks=sinks) for q, k, v in sequences[2:]]
    beside = attention.attend([others[0], mine, others[1]])[1]
    assert torch.equal(beside, alone)


@pytest.mark.parametrize("attention", _backends())
def test_sinks_are_within_float_rounding_of_a_softmax_with_a_sink_column(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(21)
    out = _attend_sunk(attention, queries, keys, values, (0, LENGTH), SINKS)
    expected = _reference(queries, keys, values, range(LENGTH), SINKS)
    assert float((out.double() - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_sinks_beside_a_logit_soft_cap_are_within_float_rounding_of_the_reference(
        attention: SequenceAttention) -> None:
    """Both at once (no checkpoint has both yet): each score capped before the row's maximum,
    the sink, uncapped, joining the maximum and the denominator after."""
    queries, keys, values = _sequence(22)
    out = _attend_sunk(attention, queries, keys, values, (0, 70, LENGTH), SINKS, WINDOW,
                       softcap=0.5)
    expected = _reference(queries, keys, values, range(LENGTH), SINKS, WINDOW, softcap=0.5)
    uncapped = _reference(queries, keys, values, range(LENGTH), SINKS, WINDOW)
    assert float((out.double() - expected).abs().max()) <= TOLERANCE
    assert float((uncapped - expected).abs().max()) > 100 * TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_sinks_in_a_sliding_window_are_within_float_rounding_of_the_reference(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(22)
    out = _attend_sunk(attention, queries, keys, values, (0, LENGTH), SINKS, WINDOW)
    expected = _reference(queries, keys, values, range(LENGTH), SINKS, WINDOW)
    assert float((out.double() - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_sinks_above_every_score_set_the_rows_maximum(attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(23)
    out = _attend_sunk(attention, queries, keys, values, (0, LENGTH), DOMINANT_SINKS)
    expected = _reference(queries, keys, values, range(LENGTH), DOMINANT_SINKS)
    assert torch.isfinite(out).all()
    assert float((out.double() - expected).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_a_prompt_with_sinks_in_odd_chunks_has_the_bits_of_it_one_shot(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(24)
    one_shot = _attend_sunk(attention, queries, keys, values, (0, LENGTH), SINKS, WINDOW)
    chunked = _attend_sunk(attention, queries, keys, values, CHUNKS, SINKS, WINDOW)
    assert torch.equal(chunked, one_shot)


@pytest.mark.parametrize("attention", _backends())
def test_a_row_with_sinks_alone_has_the_bits_it_has_beside_others(
        attention: SequenceAttention) -> None:
    _beside_others(attention)


@pytest.mark.parametrize("attention", _backends())
def test_a_layer_without_sinks_changes_no_bit(attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(25)
    plain = _attend(attention, queries, keys, values, (0, LENGTH), None)
    [none] = attention.attend([AttentionItem.of(queries, keys, values, torch.arange(LENGTH),
                                                sinks=None)])
    assert torch.equal(none, plain)


@pytest.mark.parametrize("attention", _backends())
def test_the_items_of_one_layer_share_its_sinks(attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(26)
    items = [AttentionItem.of(queries[:2], keys, values, torch.arange(2), sinks=SINKS),
             AttentionItem.of(queries[:2], keys, values, torch.arange(2), sinks=SINKS.clone())]
    with pytest.raises(ValueError, match="share its sinks"):
        attention.attend(items)


def test_torch_flash_kernel_refuses_sinks() -> None:
    queries, keys, values = _sequence(27)
    item = AttentionItem.of(queries[:4], keys, values, torch.arange(4), sinks=SINKS)
    with pytest.raises(ValueError, match="no attention sinks"):
        FlashBlockAttention().attend([item])


@needs_triton
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@interpreted
def test_the_triton_kernel_adds_sinks_exactly_and_chunk_for_chunk(device: str) -> None:
    from gateway.engine.attention.triton_paged import TritonPagedAttention

    attention = TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8)
    queries, keys, values = (t.to(device) for t in _sequence(28))
    sinks = SINKS.to(device)
    for window in (None, WINDOW):
        one_shot = _attend_sunk(attention, queries, keys, values, (0, LENGTH), sinks, window)
        expected = _reference(queries.cpu(), keys.cpu(), values.cpu(), range(LENGTH), SINKS,
                              window)
        assert float((one_shot.cpu().double() - expected).abs().max()) <= TOLERANCE
        assert torch.equal(_attend_sunk(attention, queries, keys, values, CHUNKS, sinks, window),
                           one_shot)


@needs_triton
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@interpreted
def test_the_triton_kernel_adds_sinks_beside_a_logit_soft_cap(device: str) -> None:
    """Both compile-time flags at once: the scores capped, the sink folded in uncapped."""
    from gateway.engine.attention.triton_paged import TritonPagedAttention

    attention = TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8)
    queries, keys, values = (t.to(device) for t in _sequence(29))
    one_shot = _attend_sunk(attention, queries, keys, values, (0, LENGTH), SINKS.to(device),
                            WINDOW, softcap=0.5)
    expected = _reference(queries.cpu(), keys.cpu(), values.cpu(), range(LENGTH), SINKS,
                          WINDOW, softcap=0.5)
    assert float((one_shot.cpu().double() - expected).abs().max()) <= TOLERANCE


@needs_triton
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@interpreted
def test_the_triton_kernels_rows_with_sinks_keep_their_bits_beside_others(device: str) -> None:
    from gateway.engine.attention.triton_paged import TritonPagedAttention

    _beside_others(TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8), device)


@needs_triton
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@interpreted
def test_the_triton_kernels_split_launch_adds_sinks_as_one_program_does(device: str) -> None:
    from gateway.engine.attention.triton_paged import TritonPagedAttention

    queries, keys, values = (t.to(device) for t in _sequence(29))
    sinks = SINKS.to(device)
    apart, together = (TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8,
                                            split_parallel=parallel) for parallel in (True, False))
    assert torch.equal(_attend_sunk(apart, queries, keys, values, (0, LENGTH), sinks),
                       _attend_sunk(together, queries, keys, values, (0, LENGTH), sinks))
