"""An LFM2 short-convolution layer (its ``conv`` layers) computed for one sequence's new rows
from the window it kept, with the same bits however its tokens arrive.

The layer, as the checkpoint's module holds it: ``in_proj`` gives each token ``B``, ``C`` and
``x`` (thirds of its output, in that order); ``B * x`` runs through a short causal convolution
(no activation); the result times ``C`` is projected back (``out_proj``). All a sequence keeps
is the convolution's last ``L_cache - 1`` inputs (``B * x`` of its last tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from gateway.engine.forward.recurrent.layer_state import LayerStep, Project, RecurrentState
from gateway.engine.forward.recurrent.short_conv import ConvWindow, causal_conv


def lfm2_start(config: Any, device: torch.device | str = "cpu") -> RecurrentState:
    """The state of a sequence with no tokens."""
    return RecurrentState(ConvWindow.empty(int(config.conv_L_cache), int(config.hidden_size),
                                           device=device))


def lfm2_conv(module: Any, rows: torch.Tensor, state: RecurrentState, *,
              project: Project) -> LayerStep:
    """The layer's output for a sequence's new ``rows`` ``[n, hidden]`` after ``state``."""
    gated, after = lfm2_mix(module, project(module.in_proj, rows), state)
    return LayerStep(outputs=project(module.out_proj, gated), state=after)


def lfm2_mix(module: Any, projected: torch.Tensor,
             state: RecurrentState) -> tuple[torch.Tensor, RecurrentState]:
    """The part between the layer's two products, for one sequence: its rows of ``in_proj``
    (``[n, 3 * hidden]``: B | C | x) after ``state`` to what ``out_proj`` multiplies
    (``[n, hidden]``), and the state after them. Every product is row-wise, so a step may
    multiply every sequence's rows at once and mix each sequence's alone."""
    b, c, x = projected.chunk(3, dim=-1)
    convolved, window = causal_conv(state.conv, b * x, module.conv.weight.squeeze(1),
                                    module.conv.bias)
    return c * convolved, RecurrentState(window)
