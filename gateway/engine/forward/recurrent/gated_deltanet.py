"""A Gated DeltaNet layer (the ``linear_attention`` layers of Qwen3-Next and Qwen3.5) computed
for one sequence's new rows from the state it kept, with the same bits however its tokens
arrive.

The layer, as the checkpoint's module holds it: projections give each token its query, key,
value, gates ``z`` and ``b`` and ``a`` per value head (``_projections``); a short causal
convolution with SiLU runs over the queries, keys and values; queries and keys are
L2-normalised (queries then scaled by ``key_dim ** -0.5``), each key head serving
``value_heads / key_heads`` value heads; ``beta = sigmoid(b)`` and
``g = -exp(A_log) * softplus(a + dt_bias)``; the gated delta rule (``chunked_scan``) reads
them; its output is normalised per value head and gated by ``silu(z)`` (``norm``), then
``out_proj``.

Every step here is per token (the products through ``project``, which the caller makes
row-invariant; norms over a token's own numbers; the convolution and the scan as their modules
say), so what a sequence keeps between steps -- its ``RecurrentState`` -- is all that links its
steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gateway.engine.forward.recurrent.chunked_scan import (
    ScanInputs,
    ScanStream,
    scan_rows,
    scan_step,
)
from gateway.engine.forward.recurrent.lanes import by_row
from gateway.engine.forward.recurrent.layer_state import LayerStep, Project, RecurrentState
from gateway.engine.forward.recurrent.short_conv import ConvWindow, causal_conv, causal_conv_rows

L2_EPS = 1e-6
"""The L2 norm's epsilon (the FLA kernels' and transformers')."""


@dataclass(frozen=True, slots=True)
class DeltaNetShape:
    """A Gated DeltaNet layer's sizes (its config's ``linear_*`` fields)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @classmethod
    def of(cls, config: Any) -> DeltaNetShape:
        return cls(key_heads=int(config.linear_num_key_heads),
                   value_heads=int(config.linear_num_value_heads),
                   key_dim=int(config.linear_key_head_dim),
                   value_dim=int(config.linear_value_head_dim),
                   conv_kernel=int(config.linear_conv_kernel_dim))

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def start(self, device: torch.device | str = "cpu") -> RecurrentState:
        """The state of a sequence with no tokens."""
        return RecurrentState(
            ConvWindow.empty(self.conv_kernel, self.conv_channels, device=device),
            ScanStream.start(self.value_heads, self.key_dim, self.value_dim, device=device))


QWEN3_5_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
QWEN3_NEXT_INPUTS = ("in_proj_qkvz", "in_proj_ba")
INPUTS = QWEN3_5_INPUTS + QWEN3_NEXT_INPUTS
"""The layer's products in: Qwen3.5's four or Qwen3-Next's two (a module has one set)."""


def gated_deltanet(module: Any, shape: DeltaNetShape, rows: torch.Tensor,
                   state: RecurrentState, *, project: Project, chunk: int) -> LayerStep:
    """The layer's output for a sequence's new ``rows`` ``[n, hidden]`` after ``state``."""
    projected = {name: project(getattr(module, name), rows) for name in INPUTS
                 if getattr(module, name, None) is not None}
    gated, after, kept = deltanet_mix(module, shape, projected, state, chunk=chunk)
    return LayerStep(outputs=project(module.out_proj, gated), state=after, kept=kept)


def deltanet_mix(module: Any, shape: DeltaNetShape, projected: Mapping[str, torch.Tensor],
                 state: RecurrentState, *, chunk: int
                 ) -> tuple[torch.Tensor, RecurrentState, tuple[tuple[int, torch.Tensor], ...]]:
    """The part between the layer's products, for one sequence: its rows of the products in
    (``projected``, by name) after ``state`` to what ``out_proj`` multiplies
    (``[n, value_heads * value_dim]``), the state after them, and the scan's state at each
    chunk end passed. Every product is row-wise, so a step may multiply every sequence's rows
    at once and mix each sequence's alone."""
    mixed, z, b, a = _projections(shape, projected)
    convolved, window = causal_conv(state.conv, mixed, module.conv1d.weight.squeeze(1),
                                    module.conv1d.bias)
    assert state.scan is not None, "a Gated DeltaNet layer's state has a scan"
    step = scan_step(state.scan, _scan_inputs(module, shape, convolved, b, a), chunk,
                     delta=True)
    return (_gated_output(module, shape, step.outputs, z, mixed.dtype),
            RecurrentState(window, step.stream), step.states)


def deltanet_mix_rows(module: Any, shape: DeltaNetShape, projected: Mapping[str, torch.Tensor],
                      states: Sequence[RecurrentState], *, chunk: int
                      ) -> tuple[torch.Tensor, list[RecurrentState]]:
    """``deltanet_mix`` of one new row per sequence (row ``i`` after ``states[i]``: a decode
    step), every sequence's convolution and scan at once (``causal_conv_rows``, ``scan_rows``):
    the rows ``out_proj`` multiplies and each sequence's state after its row."""
    mixed, z, b, a = _projections(shape, projected)
    convolved, windows = causal_conv_rows([state.conv for state in states], mixed,
                                          module.conv1d.weight.squeeze(1), module.conv1d.bias)
    streams = []
    for state in states:
        assert state.scan is not None, "a Gated DeltaNet layer's state has a scan"
        streams.append(state.scan)
    outputs, after = scan_rows(streams, _scan_inputs(module, shape, convolved, b, a), chunk,
                               delta=True)
    return (_gated_output(module, shape, outputs, z, mixed.dtype),
            [RecurrentState(window, stream) for window, stream in zip(windows, after,
                                                                       strict=True)])


def _scan_inputs(module: Any, shape: DeltaNetShape, convolved: torch.Tensor, b: torch.Tensor,
                 a: torch.Tensor) -> ScanInputs:
    """What the delta rule reads of each token, from its convolved ``q | k | v`` and gates."""
    n = convolved.shape[0]
    ratio = shape.value_heads // shape.key_heads
    convolved = by_row(F.silu, convolved)
    key_width = shape.key_heads * shape.key_dim
    q, k, v = torch.split(convolved, [key_width, key_width, shape.value_heads * shape.value_dim],
                          dim=-1)
    q = _l2(q.reshape(n, shape.key_heads, shape.key_dim).float())
    k = _l2(k.reshape(n, shape.key_heads, shape.key_dim).float())
    if ratio > 1:  # each key head serves its group of value heads
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    return ScanInputs(
        queries=q * shape.key_dim ** -0.5, keys=k,
        values=v.reshape(n, shape.value_heads, shape.value_dim).float(),
        decays=-module.A_log.float().exp() * by_row(F.softplus, a.float() + module.dt_bias),
        betas=by_row(torch.sigmoid, b.float()))


def _gated_output(module: Any, shape: DeltaNetShape, attended: torch.Tensor, z: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """The scan's outputs ``[n, value_heads, value_dim]`` normed per head and gated by ``z``:
    the rows ``out_proj`` multiplies."""
    n = attended.shape[0]
    rows = attended.to(dtype).reshape(n * shape.value_heads, shape.value_dim)
    gated = _gated_norm(module.norm, rows, z.reshape(n * shape.value_heads, shape.value_dim))
    return gated.reshape(n, shape.value_heads * shape.value_dim)


def _projections(shape: DeltaNetShape,
                 projected: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each token's convolution input ``q | k | v`` ``[n, conv_channels]``, gates ``z``
    ``[n, value_heads, value_dim]``, and ``b`` and ``a`` ``[n, value_heads]``: from Qwen3.5's
    four projections, or Qwen3-Next's two, whose outputs are grouped per key head (its query,
    key, its value heads' values and gates; then its heads' ``b`` and ``a``)."""
    if "in_proj_qkv" in projected:  # Qwen3.5
        qkv = projected["in_proj_qkv"]
        n = qkv.shape[0]
        return (qkv, projected["in_proj_z"].view(n, shape.value_heads, shape.value_dim),
                projected["in_proj_b"], projected["in_proj_a"])
    ratio = shape.value_heads // shape.key_heads
    n = projected["in_proj_qkvz"].shape[0]
    qkvz = projected["in_proj_qkvz"].view(
        n, shape.key_heads, 2 * shape.key_dim + 2 * ratio * shape.value_dim)
    ba = projected["in_proj_ba"].view(n, shape.key_heads, 2 * ratio)
    q, k, v, z = torch.split(qkvz, [shape.key_dim, shape.key_dim, ratio * shape.value_dim,
                                    ratio * shape.value_dim], dim=-1)
    b, a = torch.split(ba, [ratio, ratio], dim=-1)
    mixed = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
    return (mixed, z.reshape(n, shape.value_heads, shape.value_dim),
            b.reshape(n, shape.value_heads), a.reshape(n, shape.value_heads))


def _gated_norm(norm: Any, rows: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """``norm(rows, gates)`` of transformers' gated RMSNorm (each row normalised in float32,
    scaled by ``weight``, times ``silu(gate)``), its SiLU lane-stable (``by_row``)."""
    x = rows.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    out: torch.Tensor = (norm.weight * x.to(rows.dtype)) * by_row(F.silu, gates.float())
    return out.to(rows.dtype)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)
