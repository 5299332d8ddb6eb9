"""A layer's own attention scale (Gemma's ``query_pre_attn_scalar ** -0.5``) in every attention
the engine runs: within float rounding of exact attention with that scale, and no bit changed
where the scale named is the default one."""

from __future__ import annotations

import math

import pytest
import torch

from gateway.engine.attention.flash import FlashBlockAttention
from gateway.engine.attention.tiled import AttentionItem, SequenceAttention
from tests.gateway.engine.test_sliding_windows import (
    DIM,
    LENGTH,
    TOLERANCE,
    _attend,
    _backends,
    _sequence,
)

SCALE = 1.0 / math.sqrt(3 * DIM)


def _reference(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               scale: float) -> torch.Tensor:
    rep = queries.shape[1] // keys.shape[0]
    out = []
    for position, row in enumerate(queries.double()):
        k = keys[:, :position + 1].double().repeat_interleave(rep, 0)
        v = values[:, :position + 1].double().repeat_interleave(rep, 0)
        weights = torch.softmax(torch.einsum("hd,hkd->hk", row, k) * scale, -1)
        out.append(torch.einsum("hk,hkd->hd", weights, v))
    return torch.stack(out)


def _scaled(attention: SequenceAttention, queries: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor, scale: float | None) -> torch.Tensor:
    [out] = attention.attend([AttentionItem.of(queries, keys, values, torch.arange(LENGTH),
                                               scale=scale)])
    return out


@pytest.mark.parametrize("attention", _backends())
def test_a_layers_scale_is_within_float_rounding_of_attention_with_it(
        attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(11)
    out = _scaled(attention, queries, keys, values, SCALE)
    assert float((out.double() - _reference(queries, keys, values, SCALE)).abs().max()) \
        <= TOLERANCE


@pytest.mark.parametrize("attention", _backends())
def test_the_default_scale_named_changes_no_bit(attention: SequenceAttention) -> None:
    queries, keys, values = _sequence(12)
    default = _attend(attention, queries, keys, values, (0, LENGTH), None)
    named = _scaled(attention, queries, keys, values, 1.0 / math.sqrt(DIM))
    assert torch.equal(named, default)


def test_torch_flash_kernel_refuses_a_scale_of_its_own() -> None:
    queries, keys, values = _sequence(13)
    item = AttentionItem.of(queries[:4], keys, values, torch.arange(4), scale=SCALE)
    with pytest.raises(ValueError, match="no scale of its own"):
        FlashBlockAttention().attend([item])
