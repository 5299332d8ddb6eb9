"""Attention logit soft-capping (Gemma 2's ``attn_logit_softcapping``) in every attention the
batched forward runs: each scaled score ``s`` weighs as ``cap * tanh(s / cap)`` -- within float
rounding of exact attention so capped, alone or beside a window and a scale of its own (a Gemma 2
local layer), with a row's bits its own whatever else is attended with it and however its prompt
is chunked. The final logits' soft-cap (``final_logit_softcapping``) is checked in the
conformance suite, on whole models (tests/gateway/engine/families/).

The tiled attention and the paged C kernel run here; the Triton kernel runs in Triton's
interpreter on the CPU (tests/gateway/engine/triton_interpreter.py) and compiled on CUDA (marked
``gpu``). torch's flash kernel takes no soft-cap: it refuses one, and the route search never tries
it for a soft-capped model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from gateway.engine.attention.flash import FlashBlockAttention
from gateway.engine.attention.softcap import soft_cap_
from gateway.engine.attention.tiled import AttentionItem, SequenceAttention
from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from tests.gateway.engine.test_sliding_windows import (
    CHUNKS,
    DIM,
    LENGTH,
    TOLERANCE,
    WINDOW,
    _backends,
    _sequence,
    needs_triton,
)
from tests.gateway.engine.triton_interpreter import interpreted

CAP = 0.8
"""Below most of these random rows' scaled scores (about 1 in magnitude): the cap bites."""
SCALE = 1.0 / math.sqrt(3 * DIM)
"""A scale of the layer's own, as Gemma's ``query_pre_attn_scalar`` gives one."""


def _reference(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               positions: Sequence[int], *, cap: float | None, scale: float | None = None,
               window: int | None = None) -> torch.Tensor:
    """Attention in float64, each row over its keys (its window's) with its scores soft-capped
    as transformers' Gemma 2 caps them: scaled, divided by the cap, tanh, times the cap."""
    rep = queries.shape[1] // keys.shape[0]
    factor = scale if scale is not None else 1.0 / math.sqrt(queries.shape[-1])
    out = []
    for row, position in zip(queries.double(), positions, strict=True):
        lo = 0 if window is None else max(0, position - window + 1)
        k = keys[:, lo:position + 1].double().repeat_interleave(rep, 0)
        v = values[:, lo:position + 1].double().repeat_interleave(rep, 0)
        scores = torch.einsum("hd,hkd->hk", row, k) * factor
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        out.append(torch.einsum("hk,hkd->hd", torch.softmax(scores, -1), v))
    return torch.stack(out)


def _capped(attention: SequenceAttention, queries: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor, cuts: Sequence[int] = (0, LENGTH), *,
            scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Every position of the sequence, soft-capped at ``CAP``, attended in the pieces between
    ``cuts``."""
    parts = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        positions = torch.arange(start, end, device=queries.device)
        parts.extend(attention.attend([AttentionItem.of(
            queries[start:end], keys, values, positions, window=window, scale=scale,
            softcap=CAP)]))
    return torch.cat(parts)


def _distance(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.cpu().double() - expected).abs().max())


def test_the_cap_bites_on_these_rows() -> None:
    """Capped and uncapped exact attention are far apart here, so agreeing with the capped one
    says the cap was applied."""
    queries, keys, values = _sequence(21)
    capped = _reference(queries, keys, values, range(LENGTH), cap=CAP)
    uncapped = _reference(queries, keys, values, range(LENGTH), cap=None)
    assert _distance(capped, uncapped) > 1000 * TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_a_capped_row_is_within_float_rounding_of_attention_capped_so(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(22)
    out = _capped(attention, queries, keys, values)
    assert _distance(out, _reference(queries, keys, values, range(LENGTH), cap=CAP)) <= TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_a_cap_beside_a_window_and_a_scale_of_its_own_is_within_float_rounding(
        attention: SequenceAttention) -> None:
    """A Gemma 2 local layer: scaled by ``query_pre_attn_scalar``, windowed, capped."""
    queries, keys, values = _sequence(23)
    out = _capped(attention, queries, keys, values, scale=SCALE, window=WINDOW)
    expected = _reference(queries, keys, values, range(LENGTH), cap=CAP, scale=SCALE,
                          window=WINDOW)
    assert _distance(out, expected) <= TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_a_capped_prompt_in_odd_chunks_has_the_bits_of_it_one_shot(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(24)
    one_shot = _capped(attention, queries, keys, values, window=WINDOW)
    assert torch.equal(_capped(attention, queries, keys, values, CHUNKS, window=WINDOW), one_shot)


@pytest.mark.parametrize("attention", _backends())
def test_a_capped_rows_bits_alone_equal_its_bits_beside_other_rows(
        attention: SequenceAttention) -> None:
    """A decode row of one sequence, alone and in one call with another sequence's chunk and
    another decode row: its bits are its own."""
    queries, keys, values = _sequence(25)
    other_queries, other_keys, other_values = _sequence(26)
    position = LENGTH - 1

    def item(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
             end: int) -> AttentionItem:
        return AttentionItem.of(q[start:end], k, v, torch.arange(start, end), softcap=CAP,
                                scale=SCALE, is_decode=end - start == 1)

    [alone] = attention.attend([item(queries, keys, values, position, position + 1)])
    beside = attention.attend([item(other_queries, other_keys, other_values, 40, 107),
                               item(queries, keys, values, position, position + 1),
                               item(other_queries, other_keys, other_values, 120, 121)])
    assert torch.equal(beside[1], alone)


@pytest.mark.parametrize("attention", _backends())
def test_items_with_other_caps_in_one_call_are_refused(attention: SequenceAttention) -> None:
    """One call is one layer's attention: its items share the layer's cap."""
    queries, keys, values = _sequence(27)
    capped = AttentionItem.of(queries[:1], keys, values, torch.arange(1), softcap=CAP)
    uncapped = AttentionItem.of(queries[:1], keys, values, torch.arange(1))
    with pytest.raises(ValueError, match="soft-cap"):
        attention.attend([capped, uncapped])


def test_soft_capping_bounds_values_and_keeps_small_ones_nearly_as_they_are() -> None:
    values = torch.tensor([-100.0, -0.01, 0.0, 0.01, 100.0])
    capped = soft_cap_(values.clone(), 2.0)
    assert float(capped.abs().max()) <= 2.0
    assert torch.allclose(capped[1:4], values[1:4], atol=1e-6)
    assert torch.equal(soft_cap_(values.clone(), None), values)


def test_a_cap_is_a_positive_bound() -> None:
    with pytest.raises(ValueError, match="positive"):
        LayerFeatures(logit_softcap=0.0)
    with pytest.raises(ValueError, match="positive"):
        DecoderFeatures(family="gemma2", layers=(LayerFeatures(),), final_logit_softcap=-1.0)


def test_a_model_whose_layers_cap_says_so() -> None:
    """What the route search and the remembered route read to keep torch's flash kernel away."""
    capped = DecoderFeatures(family="gemma2",
                             layers=(LayerFeatures(logit_softcap=CAP), LayerFeatures()))
    assert capped.has_logit_softcap
    assert not DecoderFeatures.uniform("llama", 2, LayerFeatures()).has_logit_softcap


def test_torch_flash_kernel_refuses_a_soft_cap() -> None:
    queries, keys, values = _sequence(28)
    item = AttentionItem.of(queries[:4], keys, values, torch.arange(4), softcap=CAP)
    with pytest.raises(ValueError, match="no logit soft-cap"):
        FlashBlockAttention().attend([item])


@needs_triton
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@interpreted
def test_the_triton_kernel_caps_exactly_and_keeps_a_rows_bits(device: str) -> None:
    """Within float rounding of capped attention (with a window and a scale, as a Gemma 2 local
    layer), odd chunks and splits in programs of their own with one-shot's bits, and a row
    beside another sequence's with its bits alone."""
    from gateway.engine.attention.triton_paged import TritonPagedAttention

    together = TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8,
                                    split_parallel=False)
    apart = TritonPagedAttention(split_keys=32, tile_keys=16, tile_positions=8,
                                 split_parallel=True)
    queries, keys, values = (t.to(device) for t in _sequence(29))
    one_shot = _capped(together, queries, keys, values, scale=SCALE, window=WINDOW)
    expected = _reference(queries.cpu(), keys.cpu(), values.cpu(), range(LENGTH), cap=CAP,
                          scale=SCALE, window=WINDOW)
    assert _distance(one_shot, expected) <= TOLERANCE
    assert torch.equal(_capped(together, queries, keys, values, CHUNKS, scale=SCALE,
                               window=WINDOW), one_shot)
    assert torch.equal(_capped(apart, queries, keys, values, scale=SCALE, window=WINDOW),
                       one_shot)
    other_queries, other_keys, other_values = (t.to(device) for t in _sequence(30))
    last = LENGTH - 1
    row = AttentionItem.of(queries[last:], keys, values, torch.tensor([last], device=device),
                           scale=SCALE, window=WINDOW, softcap=CAP)
    other = AttentionItem.of(other_queries[50:90], other_keys, other_values,
                             torch.arange(50, 90, device=device), scale=SCALE, window=WINDOW,
                             softcap=CAP)
    [alone] = together.attend([row])
    assert torch.equal(together.attend([other, row])[1], alone)
    assert torch.equal(alone, one_shot[last:])
