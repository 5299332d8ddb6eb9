"""A Mamba-2 mixer for one sequence's new rows (``gateway.engine.forward.recurrent.mamba2``):
transformers' numbers for Granite 4.0-H's mamba layer and Falcon-H1's mixer (its multipliers,
its norm before or after the gate, or none), and the same bits however the sequence's tokens
arrive."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import FalconH1Config, GraniteMoeHybridConfig
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)

from gateway.engine.forward.recurrent.layer_state import RecurrentState
from gateway.engine.forward.recurrent.mamba2 import Mamba2Shape, mamba2

CHUNK = 4
HIDDEN = 32


def per_row(linear: Any, rows: torch.Tensor) -> torch.Tensor:
    """Each row its own product: its bits do not depend on the rows beside it."""
    return torch.stack([linear(row) for row in rows])


MAMBA: dict[str, Any] = {
    "hidden_size": HIDDEN, "mamba_expand": 2, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_chunk_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


def granite() -> tuple[Any, Any]:
    config = GraniteMoeHybridConfig(**MAMBA, layer_types=["mamba"])
    return GraniteMoeHybridMambaLayer(config, layer_idx=0), config


def falcon_h1(**options: Any) -> tuple[Any, Any]:
    config = FalconH1Config(**MAMBA, mamba_d_ssm=64, ssm_in_multiplier=0.7,
                            ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.5], **options)
    module = FalconH1Mixer(config, layer_idx=0)
    mup: Callable[[Any], torch.Tensor] = compute_mup_vector
    module.register_buffer("mup_vector", mup(config), persistent=False)
    return module, config


MIXERS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "granite-4.0-h": granite,
    "falcon-h1 (norm before the gate)": lambda: falcon_h1(mamba_norm_before_gate=True),
    "falcon-h1 (gate before the norm)": lambda: falcon_h1(mamba_norm_before_gate=False),
    "falcon-h1 (no norm)": lambda: falcon_h1(mamba_rms_norm=False),
}


@pytest.fixture(scope="module", params=sorted(MIXERS))
def layer(request: pytest.FixtureRequest) -> tuple[Any, Mamba2Shape]:
    torch.manual_seed(0)
    module, config = MIXERS[request.param]()
    module.eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3)
        module.A_log.uniform_(-1.0, 1.0)
    return module, Mamba2Shape.of(config)


def hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def run(layer: tuple[Any, Mamba2Shape], rows: torch.Tensor,
        sizes: list[int]) -> tuple[torch.Tensor, RecurrentState]:
    module, shape = layer
    state = shape.start()
    outputs, at = [], 0
    with torch.inference_mode():
        for size in sizes:
            step = mamba2(module, shape, rows[at:at + size], state, project=per_row, chunk=CHUNK)
            outputs.append(step.outputs)
            state, at = step.state, at + size
    return torch.cat(outputs), state


def test_it_gives_the_numbers_of_transformers_mixer(layer: tuple[Any, Mamba2Shape]) -> None:
    rows = hidden(21, seed=1)
    ours, _ = run(layer, rows, [21])
    with torch.inference_mode():
        theirs = layer[0](rows.unsqueeze(0))[0]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 20).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.integers(1, 4), min_size=n, max_size=n))),
    st.integers(0, 2**16))
def test_steps_of_any_size_give_the_bits_of_one_prompt(
        layer: tuple[Any, Mamba2Shape], case: tuple[int, list[int]],
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
