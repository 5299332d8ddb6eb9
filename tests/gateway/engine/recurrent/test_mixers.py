"""The conformance suite of the recurrent layer kinds (``gateway.engine.forward.recurrent.
mixers``), run over every checkpoint layer each kind reads: transformers' numbers for a
sequence in one step, and the same bits -- outputs, convolution window and scan state --
however the sequence's tokens arrive."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    FalconH1Config,
    GraniteMoeHybridConfig,
    Lfm2Config,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)
from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Mixer, compute_mup_vector
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    GraniteMoeHybridMambaLayer,
)
from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from gateway.engine.forward.recurrent.chunked_scan import stacking_is_exact
from gateway.engine.forward.recurrent.layer_state import RecurrentState
from gateway.engine.forward.recurrent.mixers import RECURRENT_MIXERS, RecurrentMixer

HIDDEN = 32
CHUNK = 4

DELTANET: dict[str, Any] = {
    "hidden_size": HIDDEN, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 6, "linear_conv_kernel_dim": 4,
    "num_hidden_layers": 1, "layer_types": ["linear_attention"]}
MAMBA: dict[str, Any] = {
    "hidden_size": HIDDEN, "mamba_expand": 2, "mamba_n_heads": 4, "mamba_d_head": 16,
    "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 4, "mamba_chunk_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}


@dataclass(frozen=True)
class Case:
    """A checkpoint's recurrent layer and the kind that reads it."""

    mixer: str
    build: Callable[[], tuple[Any, Any]]  # (module, config)


def falcon_h1(**options: Any) -> tuple[Any, Any]:
    config = FalconH1Config(**MAMBA, mamba_d_ssm=64, ssm_in_multiplier=0.7,
                            ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.5], **options)
    module = FalconH1Mixer(config, layer_idx=0)
    mup: Callable[[Any], torch.Tensor] = compute_mup_vector
    module.register_buffer("mup_vector", mup(config), persistent=False)
    return module, config


def of(module_class: Any, config: Any) -> tuple[Any, Any]:
    return module_class(config, layer_idx=0), config


CASES: dict[str, Case] = {
    "qwen3-next": Case("gated_deltanet", lambda: of(Qwen3NextGatedDeltaNet,
                                                    Qwen3NextConfig(**DELTANET))),
    "qwen3.5": Case("gated_deltanet", lambda: of(Qwen3_5GatedDeltaNet,
                                                 Qwen3_5TextConfig(**DELTANET))),
    "granite-4.0-h": Case("mamba2", lambda: of(GraniteMoeHybridMambaLayer,
                                               GraniteMoeHybridConfig(**MAMBA,
                                                                      layer_types=["mamba"]))),
    "falcon-h1 (norm before the gate)": Case(
        "mamba2", lambda: falcon_h1(mamba_norm_before_gate=True)),
    "falcon-h1 (gate before the norm)": Case(
        "mamba2", lambda: falcon_h1(mamba_norm_before_gate=False)),
    "falcon-h1 (no norm)": Case("mamba2", lambda: falcon_h1(mamba_rms_norm=False)),
    "lfm2": Case("lfm2_conv", lambda: of(Lfm2ShortConv, Lfm2Config(
        hidden_size=HIDDEN, num_hidden_layers=1, layer_types=["conv"], num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3))),
}


@dataclass(frozen=True)
class Layer:
    mixer: RecurrentMixer
    module: Any
    config: Any


def per_row(linear: Any, rows: torch.Tensor) -> torch.Tensor:
    """Each row its own product: its bits do not depend on the rows beside it."""
    return torch.stack([linear(row) for row in rows])


@pytest.fixture(scope="module", params=sorted(CASES))
def layer(request: pytest.FixtureRequest) -> Layer:
    case = CASES[request.param]
    torch.manual_seed(0)
    module, config = case.build()
    module.eval()
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.3)
        if hasattr(module, "A_log"):
            module.A_log.uniform_(-1.0, 1.0)
    return Layer(RECURRENT_MIXERS[case.mixer], module, config)


def hidden(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed))


def run(layer: Layer, rows: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, RecurrentState]:
    state = layer.mixer.start(layer.config, "cpu")
    outputs, at = [], 0
    with torch.inference_mode():
        for size in sizes:
            step = layer.mixer.step(layer.module, layer.config, rows[at:at + size], state,
                                    project=per_row, chunk=CHUNK)
            outputs.append(step.outputs)
            state, at = step.state, at + size
    return torch.cat(outputs), state


def test_every_case_names_a_registered_kind_and_every_kind_has_a_case() -> None:
    assert {case.mixer for case in CASES.values()} == set(RECURRENT_MIXERS)


def test_one_step_gives_the_numbers_of_transformers_layer(layer: Layer) -> None:
    rows = hidden(21, seed=1)
    ours, _ = run(layer, rows, [21])
    with torch.inference_mode():
        theirs = layer.module(rows.unsqueeze(0))[0]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 20), st.integers(0, 2**16), st.data())
def test_steps_of_any_size_give_the_bits_of_one_step(layer: Layer, n: int, seed: int,
                                                     data: st.DataObject) -> None:
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=n)) if n > 1 else []))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    rows = hidden(n, seed)
    whole, whole_state = run(layer, rows, [n])
    stepped, stepped_state = run(layer, rows, sizes)
    assert torch.equal(stepped, whole)
    assert torch.equal(stepped_state.conv.inputs, whole_state.conv.inputs)
    assert (stepped_state.scan is None) == (whole_state.scan is None) == (not layer.mixer.scans)
    if stepped_state.scan is not None and whole_state.scan is not None:
        assert torch.equal(stepped_state.scan.state, whole_state.scan.state)


def test_the_batched_steps_products_around_mix_give_the_bits_of_step(layer: Layer) -> None:
    """What the batched step does with a kind (``recurrent_step.RecurrentLayers.mix``): the rows
    made ``before`` the products, every product in, the per-sequence ``mix``, the product out --
    the same bits as the kind's one-sequence ``step``."""
    kind = layer.mixer
    assert kind.mix is not None
    rows = hidden(21, seed=3)
    with torch.inference_mode():
        start = kind.start(layer.config, "cpu")
        step = kind.step(layer.module, layer.config, rows, start, project=per_row, chunk=CHUNK)
        into = rows if kind.before is None else kind.before(layer.module, rows)
        projected = {name: per_row(getattr(layer.module, name), into) for name in kind.inputs
                     if getattr(layer.module, name, None) is not None}
        mixed, after = kind.mix(layer.module, layer.config, projected, start, CHUNK)
        out = per_row(getattr(layer.module, kind.output), mixed)
    assert torch.equal(out, step.outputs)
    assert torch.equal(after.conv.inputs, step.state.conv.inputs)
    if after.scan is not None:
        assert step.state.scan is not None
        assert torch.equal(after.scan.state, step.state.scan.state)


def test_decoding_rows_mixed_at_once_give_each_sequence_the_bits_of_mix_alone(
        layer: Layer) -> None:
    """A decode step's sequences through ``mix_rows`` at once -- from states of differing
    lengths, some rows ending a chunk -- each get the rows and state ``mix`` gives it alone."""
    kind = layer.mixer
    mix, mix_rows = kind.mix, kind.mix_rows
    if mix_rows is None:
        pytest.skip(f"{kind.name} mixes each decoding sequence alone")
    assert mix is not None
    scan = kind.start(layer.config, "cpu").scan
    assert scan is not None
    heads, key_dim, value_dim = scan.state.shape
    if not stacking_is_exact(heads, key_dim, value_dim, CHUNK, delta=kind.delta_rule):
        pytest.skip("stacked scans do not keep their bits on this machine (so none stacks)")
    lengths = [0, 1, 3, 6, 7, 2]  # rows ending a chunk of 4: after 3 and 7 tokens
    with torch.inference_mode():
        states = []
        for seed, length in enumerate(lengths):
            state = kind.start(layer.config, "cpu")
            if length:
                _, state = mix(layer.module, layer.config,
                               projected_of(layer, hidden(length, seed)), state, CHUNK)
            states.append(state)
        rows = projected_of(layer, hidden(len(lengths), seed=99))
        together, after = mix_rows(layer.module, layer.config, rows, states, CHUNK)
        for i, state in enumerate(states):
            alone, alone_after = mix(layer.module, layer.config,
                                     {name: taken[i:i + 1] for name, taken in rows.items()},
                                     state, CHUNK)
            assert torch.equal(together[i:i + 1], alone)
            assert torch.equal(after[i].conv.inputs, alone_after.conv.inputs)
            ours, theirs = after[i].scan, alone_after.scan
            assert ours is not None and theirs is not None
            assert ours.position == theirs.position
            assert torch.equal(ours.state, theirs.state)
            assert torch.equal(ours.waiting.keys, theirs.waiting.keys)


def projected_of(layer: Layer, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The kind's products in of ``rows``, by name, each row its own."""
    kind = layer.mixer
    into = rows if kind.before is None else kind.before(layer.module, rows)
    return {name: per_row(getattr(layer.module, name), into) for name in kind.inputs
            if getattr(layer.module, name, None) is not None}
