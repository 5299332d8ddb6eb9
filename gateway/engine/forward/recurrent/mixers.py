"""The recurrent layer kinds, by name: what a family names for each of its recurrent layers
(``gateway.engine.models.families``) and what the forward calls for it.

A kind is one module here (its layer's arithmetic) plus one line in ``RECURRENT_MIXERS``; every
kind runs the one conformance suite (``tests/gateway/engine/recurrent/test_mixers.py``):
transformers' numbers, and the same bits in steps of any size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward.recurrent.gated_deltanet import DeltaNetShape, gated_deltanet
from gateway.engine.forward.recurrent.layer_state import LayerStep, Project, RecurrentState
from gateway.engine.forward.recurrent.lfm2_conv import lfm2_conv, lfm2_mix, lfm2_start
from gateway.engine.forward.recurrent.mamba2 import Mamba2Shape, mamba2


@dataclass(frozen=True, slots=True)
class RecurrentMixer:
    """One kind of recurrent layer.

    Attributes:
        name: its name in ``RECURRENT_MIXERS`` and in route notes.
        start: the state of a sequence with no tokens, from the model's config.
        step: the layer's output for a sequence's new rows after its state:
            ``step(module, config, rows, state, project=..., chunk=...)``.
        scans: whether it has a chunked scan (whose chunk must divide the block size).
        mix: where the layer is a row-wise product in (``products[0]``), a per-sequence part,
            and a row-wise product out (``products[1]``): the part, ``mix(module, projected,
            state) -> (rows for the product out, state after)``, so a step multiplies every
            sequence's rows at once; None: only ``step``, one sequence at a time.
        products: the module's products in and out, where ``mix`` is given.
    """

    name: str
    start: Callable[[Any, torch.device | str], RecurrentState]
    step: Callable[..., LayerStep]
    scans: bool
    mix: Callable[[Any, torch.Tensor, RecurrentState],
                  tuple[torch.Tensor, RecurrentState]] | None = None
    products: tuple[str, str] = ("in_proj", "out_proj")


def _deltanet_step(module: Any, config: Any, rows: torch.Tensor, state: RecurrentState, *,
                   project: Project, chunk: int) -> LayerStep:
    return gated_deltanet(module, DeltaNetShape.of(config), rows, state, project=project,
                          chunk=chunk)


def _mamba2_step(module: Any, config: Any, rows: torch.Tensor, state: RecurrentState, *,
                 project: Project, chunk: int) -> LayerStep:
    return mamba2(module, Mamba2Shape.of(config), rows, state, project=project, chunk=chunk)


def _lfm2_step(module: Any, config: Any, rows: torch.Tensor, state: RecurrentState, *,
               project: Project, chunk: int) -> LayerStep:
    return lfm2_conv(module, rows, state, project=project)


RECURRENT_MIXERS: dict[str, RecurrentMixer] = {
    mixer.name: mixer for mixer in (
        RecurrentMixer("gated_deltanet", lambda config, device: DeltaNetShape.of(config).start(
            device), _deltanet_step, scans=True),
        RecurrentMixer("mamba2", lambda config, device: Mamba2Shape.of(config).start(device),
                       _mamba2_step, scans=True),
        RecurrentMixer("lfm2_conv", lfm2_start, _lfm2_step, scans=False, mix=lfm2_mix),
    )
}
"""Every recurrent layer kind, by name."""
