"""A step's K/V written into the page pool, and its attention rows joined, a few launches a layer.

Why: the forward used to write each sequence's K/V and copy back each sequence's attention
output one at a time, every layer: with 32 decode rows on a 32-layer model that is ~2,000 page
writes and ~1,000 copies a step, each a kernel launch on a GPU (a few microseconds of CPU time
apiece, more than the work). Here the slots of every row are found once per step
(``KVSequence.claim``) and each layer's K and V go in with one scatter per kind
(``PagePool.scatter``); the attention outputs of the rows are joined with one concatenation.
The values written and read are the same bits as before, in the same places: only the number
of launches changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gateway.engine.kv.sequence import KVSequence
from tiers.page_pool import PagePool


@dataclass(frozen=True, slots=True)
class StepWrites:
    """Where a step's rows of K/V go: pool slots, and which rows of the step's K/V fill them."""

    pool: PagePool
    slots: torch.Tensor
    """Pool slots on the pool's device, one per written row, in row order."""
    rows: slice | torch.Tensor
    """The step's rows that are written (padding rows are not): a slice where they are
    consecutive, else their indices on the device."""

    @classmethod
    def claim(cls, sequences: Sequence[KVSequence], spans: Sequence[tuple[int, int]],
              device: torch.device) -> StepWrites | None:
        """Claim each sequence's next ``end - start`` positions (its rows ``spans[i]`` of the
        step) and note where they go; None where the sequences are not all of one pool (each
        then writes its own)."""
        if not sequences:
            return None
        pool = sequences[0].pool
        if any(seq.pool is not pool for seq in sequences):
            return None
        order, consecutive = _row_order(spans)
        slot_parts = [sequences[i].claim(spans[i][1] - spans[i][0]) for i in order]
        ordered = [spans[i] for i in order]
        rows: slice | torch.Tensor
        if consecutive:
            rows = slice(ordered[0][0], ordered[-1][1])
        else:
            rows = torch.cat([torch.arange(start, end) for start, end in ordered]).to(device)
        return cls(pool=pool, slots=torch.cat(slot_parts).to(pool.device), rows=rows)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write the step's ``keys`` and ``values`` ``[rows, kv_heads, head_dim]`` of one layer."""
        if isinstance(self.rows, slice):
            k, v = keys[self.rows], values[self.rows]
        else:
            k, v = keys.index_select(0, self.rows), values.index_select(0, self.rows)
        self.pool.scatter(layer, self.slots, k.transpose(0, 1), v.transpose(0, 1))


def join_rows(outputs: Sequence[torch.Tensor], spans: Sequence[tuple[int, int]],
              like: torch.Tensor) -> torch.Tensor:
    """The step's attention output ``like``-shaped: each item's rows at its span, zeros in the
    padding rows; one concatenation where the spans run on from row 0."""
    num_rows = like.shape[0]
    order, consecutive = _row_order(spans)
    if order and consecutive and spans[order[0]][0] == 0:
        parts = [outputs[i] for i in order]
        end = spans[order[-1]][1]
        if end < num_rows:
            parts.append(like.new_zeros((num_rows - end, *like.shape[1:])))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    joined = torch.zeros_like(like)
    for (start, end), rows in zip(spans, outputs, strict=True):
        joined[start:end] = rows
    return joined


def _row_order(spans: Sequence[tuple[int, int]]) -> tuple[list[int], bool]:
    """The items in the order of their rows, and whether each item's rows follow the last's."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    consecutive = all(spans[a][1] == spans[b][0] for a, b in zip(order, order[1:], strict=False))
    return order, consecutive
