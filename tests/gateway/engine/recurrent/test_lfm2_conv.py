"""An LFM2 short-convolution layer for one sequence's new rows
(``gateway.engine.forward.recurrent.lfm2_conv``): transformers' layer's numbers, and the same
bits however the sequence's tokens arrive."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Lfm2Config
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

from gateway.engine.forward.recurrent.layer_state import RecurrentState
from gateway.engine.forward.recurrent.lfm2_conv import lfm2_conv, lfm2_start

HIDDEN = 32


def per_row(linear: Any, rows: torch.Tensor) -> torch.Tensor:
    """Each row its own product: its bits do not depend on the rows beside it."""
    return torch.stack([linear(row) for row in rows])


@pytest.fixture(scope="module")
def layer() -> tuple[Lfm2ShortConv, Lfm2Config]:
    config = Lfm2Config(hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["conv"],
                        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3)
    torch.manual_seed(0)
    module = Lfm2ShortConv(config, layer_idx=0).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3)
    return module, config


def hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def run(layer: tuple[Any, Lfm2Config], rows: torch.Tensor,
        sizes: list[int]) -> tuple[torch.Tensor, RecurrentState]:
    module, config = layer
    state = lfm2_start(config)
    outputs, at = [], 0
    with torch.inference_mode():
        for size in sizes:
            step = lfm2_conv(module, rows[at:at + size], state, project=per_row)
            outputs.append(step.outputs)
            state, at = step.state, at + size
    return torch.cat(outputs), state


def test_it_gives_the_numbers_of_transformers_lfm2_conv_layer(
        layer: tuple[Lfm2ShortConv, Lfm2Config]) -> None:
    rows = hidden(19, seed=1)
    ours, _ = run(layer, rows, [19])
    with torch.inference_mode():
        theirs = layer[0](rows.unsqueeze(0))[0]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 20), st.integers(0, 2**16), st.data())
def test_steps_of_any_size_give_the_bits_of_one_prompt(
        layer: tuple[Lfm2ShortConv, Lfm2Config], n: int, seed: int,
        data: st.DataObject) -> None:
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=n)) if n > 1 else []))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    rows = hidden(n, seed)
    whole, whole_state = run(layer, rows, [n])
    stepped, stepped_state = run(layer, rows, sizes)
    assert torch.equal(stepped, whole)
    assert torch.equal(stepped_state.conv.inputs, whole_state.conv.inputs)
