"""The recurrent layer kinds, by name: what a family names for each of its recurrent layers
(``gateway.engine.models.families``) and what the forward calls for it.

A kind is one module here (its layer's arithmetic) plus one line in ``RECURRENT_MIXERS``; every
kind runs the one conformance suite (``tests/gateway/engine/recurrent/test_mixers.py``):
transformers' numbers, and the same bits in steps of any size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward.recurrent.gated_deltanet import INPUTS as DELTANET_INPUTS
from gateway.engine.forward.recurrent.gated_deltanet import (
    DeltaNetShape,
    deltanet_mix,
    deltanet_mix_rows,
    gated_deltanet,
)
from gateway.engine.forward.recurrent.layer_state import LayerStep, Project, RecurrentState
from gateway.engine.forward.recurrent.lfm2_conv import lfm2_conv, lfm2_mix, lfm2_start
from gateway.engine.forward.recurrent.mamba2 import (
    Mamba2Shape,
    mamba2,
    mamba2_mix,
    mamba2_mix_rows,
    scaled_input,
)

Mix = Callable[[Any, Any, Mapping[str, torch.Tensor], RecurrentState, int],
              tuple[torch.Tensor, RecurrentState]]
"""``mix(module, config, projected, state, chunk)``: the part of a layer between its products,
for one sequence: its rows of the products in (by name) after ``state`` to the rows the product
out multiplies, and its state after them."""


MixRows = Callable[[Any, Any, Mapping[str, torch.Tensor], Sequence[RecurrentState], int],
                   tuple[torch.Tensor, list[RecurrentState]]]
"""``mix_rows(module, config, projected, states, chunk)``: ``Mix`` for one new row per sequence
(a decode step), row ``i`` after ``states[i]``, every sequence at once: the rows the product out
multiplies and each sequence's state after its row, with the bits ``Mix`` gives each alone."""


@dataclass(frozen=True, slots=True)
class RecurrentMixer:
    """One kind of recurrent layer.

    Attributes:
        name: its name in ``RECURRENT_MIXERS`` and in route notes.
        start: the state of a sequence with no tokens, from the model's config.
        step: the layer's output for a sequence's new rows after its state:
            ``step(module, config, rows, state, project=..., chunk=...)``.
        scans: whether it has a chunked scan (whose chunk must divide the block size).
        mix: where the layer is row-wise products in (``inputs``), a per-sequence part, and a
            row-wise product out (``output``): the part (``Mix``), so a step multiplies every
            sequence's rows at once; None: only ``step``, one sequence at a time.
        inputs: the module's products in, where ``mix`` is given (those the module has).
        output: its product out.
        before: what the rows are made before the products in (Falcon-H1's input multiplier);
            None: the layer's normed rows as they are.
        mix_rows: ``mix`` for a decode step's sequences at once (``MixRows``); None: each
            sequence's row through ``mix``.
        delta_rule: its scan's rule is the delta rule (else the decayed linear rule), for
            checking that stacked scans keep their bits (``stacking_is_exact``).
    """

    name: str
    start: Callable[[Any, torch.device | str], RecurrentState]
    step: Callable[..., LayerStep]
    scans: bool
    mix: Mix | None = None
    inputs: tuple[str, ...] = ("in_proj",)
    output: str = "out_proj"
    before: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    mix_rows: MixRows | None = None
    delta_rule: bool = False


def _deltanet_step(module: Any, config: Any, rows: torch.Tensor, state: RecurrentState, *,
                   project: Project, chunk: int) -> LayerStep:
    return gated_deltanet(module, DeltaNetShape.of(config), rows, state, project=project,
                          chunk=chunk)


def _deltanet_mix(module: Any, config: Any, projected: Mapping[str, torch.Tensor],
                  state: RecurrentState, chunk: int) -> tuple[torch.Tensor, RecurrentState]:
    gated, after, _ = deltanet_mix(module, DeltaNetShape.of(config), projected, state,
                                   chunk=chunk)
    return gated, after


def _deltanet_mix_rows(module: Any, config: Any, projected: Mapping[str, torch.Tensor],
                       states: Sequence[RecurrentState], chunk: int
                       ) -> tuple[torch.Tensor, list[RecurrentState]]:
    return deltanet_mix_rows(module, DeltaNetShape.of(config), projected, states, chunk=chunk)


def _mamba2_step(module: Any, config: Any, rows: torch.Tensor, state: RecurrentState, *,
                 project: Project, chunk: int) -> LayerStep:
    return mamba2(module, Mamba2Shape.of(config), rows, state, project=project, chunk=chunk)


def _mamba2_mix(module: Any, config: Any, projected: Mapping[str, torch.Tensor],
                state: RecurrentState, chunk: int) -> tuple[torch.Tensor, RecurrentState]:
    gated, after, _ = mamba2_mix(module, Mamba2Shape.of(config), projected["in_proj"], state,
                                 chunk=chunk)
    return gated, after


def _mamba2_mix_rows(module: Any, config: Any, projected: Mapping[str, torch.Tensor],
                     states: Sequence[RecurrentState], chunk: int
                     ) -> tuple[torch.Tensor, list[RecurrentState]]:
    return mamba2_mix_rows(module, Mamba2Shape.of(config), projected["in_proj"], states,
                           chunk=chunk)


def _lfm2_step(module: Any, config: Any, rows: torch.Tensor, state: RecurrentState, *,
               project: Project, chunk: int) -> LayerStep:
    return lfm2_conv(module, rows, state, project=project)


def _lfm2_mix(module: Any, config: Any, projected: Mapping[str, torch.Tensor],
              state: RecurrentState, chunk: int) -> tuple[torch.Tensor, RecurrentState]:
    return lfm2_mix(module, projected["in_proj"], state)


RECURRENT_MIXERS: dict[str, RecurrentMixer] = {
    mixer.name: mixer for mixer in (
        RecurrentMixer("gated_deltanet", lambda config, device: DeltaNetShape.of(config).start(
            device), _deltanet_step, scans=True, mix=_deltanet_mix, inputs=DELTANET_INPUTS,
            mix_rows=_deltanet_mix_rows, delta_rule=True),
        RecurrentMixer("mamba2", lambda config, device: Mamba2Shape.of(config).start(device),
                       _mamba2_step, scans=True, mix=_mamba2_mix, before=scaled_input,
                       mix_rows=_mamba2_mix_rows),
        RecurrentMixer("lfm2_conv", lfm2_start, _lfm2_step, scans=False, mix=_lfm2_mix),
    )
}
"""Every recurrent layer kind, by name."""
