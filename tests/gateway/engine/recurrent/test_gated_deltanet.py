"""A Gated DeltaNet layer for one sequence's new rows (``gateway.engine.forward.recurrent.
gated_deltanet``): transformers' Qwen3-Next and Qwen3.5 layers' numbers, and the same bits
however the sequence's tokens arrive."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from gateway.engine.forward.recurrent.gated_deltanet import DeltaNetShape, gated_deltanet
from gateway.engine.forward.recurrent.layer_state import RecurrentState

CHUNK = 4


def per_row(linear: Any, rows: torch.Tensor) -> torch.Tensor:
    """Each row its own product: its bits do not depend on the rows beside it."""
    return torch.stack([linear(row) for row in rows])


SIZES = {"hidden_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
         "linear_key_head_dim": 8, "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4,
         "num_hidden_layers": 1, "layer_types": ["linear_attention"]}
MODELS = {"qwen3_next": (Qwen3NextConfig, Qwen3NextGatedDeltaNet),
          "qwen3_5": (Qwen3_5TextConfig, Qwen3_5GatedDeltaNet)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def layer(request: pytest.FixtureRequest) -> tuple[Any, DeltaNetShape]:
    config_class, module_class = MODELS[request.param]
    config = config_class(**SIZES)
    torch.manual_seed(0)
    module = module_class(config, layer_idx=0).eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3)
        module.A_log.uniform_(-1.0, 1.0)
    return module, DeltaNetShape.of(config)


def hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))


def run(layer: tuple[Any, DeltaNetShape], rows: torch.Tensor, sizes: list[int],
        state: RecurrentState | None = None) -> tuple[torch.Tensor, RecurrentState]:
    module, shape = layer
    state = state if state is not None else shape.start()
    outputs, at = [], 0
    with torch.inference_mode():
        for size in sizes:
            step = gated_deltanet(module, shape, rows[at:at + size], state, project=per_row,
                                  chunk=CHUNK)
            outputs.append(step.outputs)
            state, at = step.state, at + size
    return torch.cat(outputs), state


def test_it_gives_the_numbers_of_transformers_layer(layer: tuple[Any, DeltaNetShape]) -> None:
    rows = hidden(23, seed=1)
    ours, _ = run(layer, rows, [23])
    with torch.inference_mode():
        theirs = layer[0](rows.unsqueeze(0))[0]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 20).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.integers(1, 4), min_size=n, max_size=n))),
    st.integers(0, 2**16))
def test_steps_of_any_size_give_the_bits_of_one_prompt(
        layer: tuple[Any, DeltaNetShape], case: tuple[int, list[int]],
        seed: int) -> None:
    n, wanted = case
    sizes, left = [], n
    for size in wanted:
        if left == 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
    rows = hidden(n, seed)
    whole, whole_state = run(layer, rows, [n])
    stepped, stepped_state = run(layer, rows, sizes)
    assert torch.equal(stepped, whole)
    assert stepped_state.scan is not None and whole_state.scan is not None
    assert torch.equal(stepped_state.scan.state, whole_state.scan.state)
    assert torch.equal(stepped_state.conv.inputs, whole_state.conv.inputs)
