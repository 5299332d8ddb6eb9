"""Element-wise functions whose bits do not depend on how many rows a step holds.

Why: torch computes an element-wise function over a tensor in vectors of 8 or 16 numbers and
the tail that does not fill a vector one by one, and its vector and one-by-one forms of ``exp``,
``sigmoid``, ``silu`` or ``softplus`` may differ in the last bit. Where a row is a multiple of
the vector width (a model's hidden size) every number falls on the same lane whatever the row
count; where it is narrow (a recurrent layer's few heads: its ``b`` and ``a`` per head) a
number would fall in a vector in one step and in the tail in another. ``by_row`` pads each row
to ``ROW_LANES`` numbers first, so every number is computed by the vector form, at its lane.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ROW_LANES = 64
"""A multiple of every CPU's float vector width (8 with AVX2, 16 with AVX-512)."""


def by_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an element-wise ``fn``, each number's bits independent of ``x``'s other
    rows (the last dimension is a row)."""
    width = x.shape[-1]
    padded_width = -(-width // ROW_LANES) * ROW_LANES
    rows = x.reshape(-1, width)
    if padded_width != width:
        rows = torch.cat([rows, rows.new_zeros(rows.shape[0], padded_width - width)], dim=-1)
    out: torch.Tensor = fn(rows)[:, :width]
    return out.reshape(x.shape)
