"""What a sequence keeps of one recurrent layer between steps, and what a step of it gives:
the records every recurrent layer module here shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward.recurrent.chunked_scan import ScanStream
from gateway.engine.forward.recurrent.short_conv import ConvWindow

Project = Callable[[Any, torch.Tensor], torch.Tensor]
"""``project(linear, rows)``: ``rows @ linear.weight.T`` (+ bias), each row's bits its own (the
route's row products)."""


@dataclass(frozen=True, slots=True)
class RecurrentState:
    """One sequence's state in one recurrent layer: its convolution's window and, for a layer
    with a scan, its stream (the state after its last whole chunk and the tokens since)."""

    conv: ConvWindow
    scan: ScanStream | None = None


@dataclass(frozen=True, slots=True)
class LayerStep:
    """One step of one sequence through a recurrent layer: the new rows' outputs
    ``[n, hidden]``, the state after them, and the scan's state at each chunk end passed."""

    outputs: torch.Tensor
    state: RecurrentState
    kept: tuple[tuple[int, torch.Tensor], ...] = ()
