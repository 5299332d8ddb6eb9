"""A Mamba-2 mixer (the ``mamba`` layers of Granite 4.0-H, Bamba, Falcon-H1, Nemotron-H)
computed for one sequence's new rows from the state it kept, with the same bits however its
tokens arrive.

The mixer, as the checkpoint's module holds it: ``in_proj`` gives each token its gate ``z``,
the convolution's input (``x``, then ``B`` and ``C`` per group) and one ``dt`` per head; a short
causal convolution with the layer's activation runs over ``x | B | C``;
``dt = clamp(softplus(dt + dt_bias), time_step_limit)``; each head's state ``h``
(``[head_dim, d_state]``) decays by ``exp(dt * A)`` (``A = -exp(A_log)``), takes
``dt * x (x) B`` and is read by ``C``; ``D * x`` is added; the result times ``silu(z)`` is
RMS-normalised per group (``norm``) and projected back (``out_proj``). Falcon-H1's mixer
scales its input by ``ssm_in_multiplier`` and ``in_proj``'s columns by ``mup_vector``, and may
normalise before the gate or not at all (``_gated_group_norm``).

The state-space step is the decayed linear rule of ``chunked_scan`` with ``q = C``, ``k = B``,
``v = dt * x`` and ``g = dt * A``: its ``[d_state, head_dim]`` state is ``h`` transposed.
"""

from __future__ import annotations

from collections.abc import Sequence
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


@dataclass(frozen=True, slots=True)
class Mamba2Shape:
    """A Mamba-2 mixer's sizes (its config's ``mamba_*`` fields)."""

    heads: int
    head_dim: int
    state_dim: int
    groups: int
    conv_kernel: int
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    @classmethod
    def of(cls, config: Any) -> Mamba2Shape:
        limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
        return cls(heads=int(config.mamba_n_heads), head_dim=int(config.mamba_d_head),
                   state_dim=int(config.mamba_d_state), groups=int(config.mamba_n_groups),
                   conv_kernel=int(config.mamba_d_conv),
                   time_step_limit=(float(limit[0]), float(limit[1])))

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return self.inner + 2 * self.groups * self.state_dim

    def start(self, device: torch.device | str = "cpu") -> RecurrentState:
        """The state of a sequence with no tokens."""
        return RecurrentState(
            ConvWindow.empty(self.conv_kernel, self.conv_channels, device=device),
            ScanStream.start(self.heads, self.state_dim, self.head_dim, device=device))


def mamba2(module: Any, shape: Mamba2Shape, rows: torch.Tensor, state: RecurrentState, *,
           project: Project, chunk: int) -> LayerStep:
    """The mixer's output for a sequence's new ``rows`` ``[n, hidden]`` after ``state``."""
    projected = project(module.in_proj, scaled_input(module, rows))
    gated, after, kept = mamba2_mix(module, shape, projected, state, chunk=chunk)
    return LayerStep(outputs=project(module.out_proj, gated), state=after, kept=kept)


def scaled_input(module: Any, rows: torch.Tensor) -> torch.Tensor:
    """The rows ``in_proj`` multiplies: Falcon-H1's scaled by ``ssm_in_multiplier`` first."""
    return _scaled(rows, getattr(module, "ssm_in_multiplier", None))


def mamba2_mix(module: Any, shape: Mamba2Shape, projected: torch.Tensor, state: RecurrentState,
               *, chunk: int
               ) -> tuple[torch.Tensor, RecurrentState, tuple[tuple[int, torch.Tensor], ...]]:
    """The part between the mixer's products, for one sequence: its rows of ``in_proj`` after
    ``state`` to what ``out_proj`` multiplies (``[n, inner]``), the state after them, and the
    scan's state at each chunk end passed. Every product is row-wise, so a step may multiply
    every sequence's rows at once and mix each sequence's alone."""
    gate, mixed, dt = _split(module, shape, projected)
    convolved, window = causal_conv(state.conv, mixed, module.conv1d.weight.squeeze(1),
                                    module.conv1d.bias)
    inputs, x = _scan_inputs(module, shape, convolved, dt)
    assert state.scan is not None, "a Mamba-2 layer's state has a scan"
    step = scan_step(state.scan, inputs, chunk, delta=False)
    return (_gated_output(module, shape, step.outputs, x, gate, projected.dtype),
            RecurrentState(window, step.stream), step.states)


def mamba2_mix_rows(module: Any, shape: Mamba2Shape, projected: torch.Tensor,
                    states: Sequence[RecurrentState], *, chunk: int
                    ) -> tuple[torch.Tensor, list[RecurrentState]]:
    """``mamba2_mix`` of one new row per sequence (row ``i`` after ``states[i]``: a decode
    step), every sequence's convolution and scan at once (``causal_conv_rows``, ``scan_rows``):
    the rows ``out_proj`` multiplies and each sequence's state after its row."""
    gate, mixed, dt = _split(module, shape, projected)
    convolved, windows = causal_conv_rows([state.conv for state in states], mixed,
                                          module.conv1d.weight.squeeze(1), module.conv1d.bias)
    inputs, x = _scan_inputs(module, shape, convolved, dt)
    streams = []
    for state in states:
        assert state.scan is not None, "a Mamba-2 layer's state has a scan"
        streams.append(state.scan)
    outputs, after = scan_rows(streams, inputs, chunk, delta=False)
    return (_gated_output(module, shape, outputs, x, gate, projected.dtype),
            [RecurrentState(window, stream) for window, stream in zip(windows, after,
                                                                       strict=True)])


def _split(module: Any, shape: Mamba2Shape,
           projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``in_proj``'s rows as the gate, the convolution's input and ``dt`` (Falcon-H1's
    per-column multipliers applied first)."""
    mup = getattr(module, "mup_vector", None)  # Falcon-H1's per-column multipliers
    if mup is not None:
        projected = projected * mup.reshape(-1)
    gate, mixed, dt = torch.split(projected, [shape.inner, shape.conv_channels, shape.heads],
                                  dim=-1)
    return gate, mixed, dt


def _scan_inputs(module: Any, shape: Mamba2Shape, convolved: torch.Tensor,
                 dt: torch.Tensor) -> tuple[ScanInputs, torch.Tensor]:
    """What the decayed linear rule reads of each token, and its ``x`` ``[n, heads,
    head_dim]`` (the skip through ``D`` reads it too)."""
    n = convolved.shape[0]
    convolved = by_row(module.act, convolved)
    x, b, c = torch.split(convolved, [shape.inner, shape.groups * shape.state_dim,
                                      shape.groups * shape.state_dim], dim=-1)
    per_group = shape.heads // shape.groups
    dt = by_row(F.softplus, dt.float() + module.dt_bias.float())
    dt = dt.clamp(min=shape.time_step_limit[0], max=shape.time_step_limit[1])
    x = x.reshape(n, shape.heads, shape.head_dim).float()
    a = -module.A_log.float().exp()

    def per_head(groups: torch.Tensor) -> torch.Tensor:
        return groups.reshape(n, shape.groups, shape.state_dim).float().repeat_interleave(
            per_group, dim=1)

    return ScanInputs(queries=per_head(c), keys=per_head(b), values=x * dt.unsqueeze(-1),
                      decays=dt * a, betas=torch.ones_like(dt)), x


def _gated_output(module: Any, shape: Mamba2Shape, outputs: torch.Tensor, x: torch.Tensor,
                  gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scan's outputs ``[n, heads, head_dim]`` plus the skip, gated and normed: the rows
    ``out_proj`` multiplies."""
    y = outputs + module.D.float()[:, None] * x
    gated = _gated_group_norm(module.norm, y.reshape(x.shape[0], shape.inner), gate,
                              shape.groups)
    return gated.to(dtype)


def _scaled(rows: torch.Tensor, multiplier: float | None) -> torch.Tensor:
    return rows if multiplier is None else rows * multiplier


def _gated_group_norm(norm: Any, rows: torch.Tensor, gate: torch.Tensor,
                      groups: int) -> torch.Tensor:
    """The mixer's output gated by ``silu(gate)`` and RMS-normalised per group in float32 (times
    ``weight``): the gate first (Granite 4.0-H, Bamba; Falcon-H1 with
    ``mamba_norm_before_gate`` false), the norm first (Falcon-H1's default), or the gate alone
    (Falcon-H1 without ``mamba_rms_norm``). The SiLU is lane-stable (``by_row``)."""
    silu_gate = by_row(F.silu, gate.float())
    if getattr(norm, "weight", None) is None:
        return rows.float() * silu_gate
    norm_first = bool(getattr(norm, "norm_before_gate", False))
    x = rows.float() if norm_first else rows.float() * silu_gate
    grouped = x.reshape(x.shape[0], groups, -1)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True)
                                    + norm.variance_epsilon)
    out: torch.Tensor = norm.weight * grouped.reshape(x.shape).to(rows.dtype)
    return out * silu_gate if norm_first else out
