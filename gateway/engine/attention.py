"""Attention whose numbers for a token depend only on that token's own sequence.

Why own the attention (DESIGN.md, "Parity"): torch's SDPA and a plain matmul-softmax give a
query row different bits depending on how many other rows share the call and how long the key
range is, so a block prefilled in one chunk would differ from the same block prefilled in
pieces, and a request's answer would change with what runs beside it. Here every reduction has
a fixed shape, fixed by absolute positions only:

- keys are cut into fixed tiles of ``TILE`` positions (tile t holds positions 64t..64t+63);
  the scores of a query against a tile are one ``[rows, head_dim] @ [head_dim, TILE]`` product
  (a reduction over ``head_dim`` only), and its tile's weighted values one
  ``[rows, TILE] @ [TILE, head_dim]`` product (a reduction over exactly ``TILE`` keys);
- keys after the query's own position are masked to ``-inf`` (so they weigh exactly 0), and
  so are the tiles a longer chunk brings in: they add exact zeros;
- the softmax uses the exact maximum over all visible scores (a max is exact in any order),
  and the tiles are combined one after the other in increasing position order, so extra
  all-zero tiles at the end change nothing.

NOTE: a matmul row's bits depend on how many rows share the product when there are few: on this
CPU build (torch 2.13, measured for every shape of SmolLM2 and the tiny test Llama) M = 4, 8
and every M >= 12 give the same bits, while M = 1-3, 5-7 and 9-11 each give others. Every
product here and in ``gateway.engine.forward`` is padded to such a row count
(``padded_row_count``). Whether
all of this holds on a given machine is not assumed: ``gateway.engine.probe`` checks it on the
real weights at start-up, and the engine falls back to the serial exact route where it fails.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

TILE = 64
"""Key positions per tile: the fixed length of every reduction over keys."""

_ROWS_ALONE = (4, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12)
"""``padded_row_count`` below 12 rows: the next of 4, 8, 12."""


def padded_row_count(num_rows: int) -> int:
    """The row count to pad a product of ``num_rows`` rows to (4, 8, or any count from 12)."""
    return _ROWS_ALONE[num_rows] if num_rows < len(_ROWS_ALONE) else num_rows

QUERY_GROUP = 256
"""Query positions attended at once in a long chunk (bounds the scores' memory)."""


class SequenceAttention(Protocol):
    """Attention of one sequence's new queries over its own keys (one implementation per device).

    Every implementation keeps the invariance contract: the output row of a query depends only
    on that query, its position and the keys/values at positions up to it.
    """

    def __call__(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """Attend ``queries`` ``[n, heads, head_dim]`` at ``positions`` ``[n]`` over K/V.

        Args:
            queries: the new tokens' queries (RoPE applied).
            keys: ``[kv_heads, capacity, head_dim]``; positions up to ``positions.max()`` hold
                this sequence's keys (RoPE applied), the rest is finite (zeros or stale).
            values: like ``keys``.
            positions: the absolute position of each query.

        Returns:
            ``[n, heads, head_dim]``.
        """
        ...


class TiledAttention:
    """The CPU implementation: fixed tiles, exact max, sequential combination of tiles."""

    def __call__(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        n, num_heads, head_dim = queries.shape
        kv_heads = keys.shape[0]
        rep = num_heads // kv_heads
        out = torch.empty_like(queries)
        scale = 1.0 / math.sqrt(head_dim)
        for start in range(0, n, QUERY_GROUP):
            end = min(n, start + QUERY_GROUP)
            out[start:end] = self._group(queries[start:end] * scale, keys, values,
                                         positions[start:end], rep)
        return out

    @staticmethod
    def _group(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, rep: int) -> torch.Tensor:
        n, num_heads, head_dim = queries.shape
        kv_heads = keys.shape[0]
        num_tiles = int(positions.max()) // TILE + 1
        span = num_tiles * TILE
        if span > keys.shape[1]:
            raise ValueError(f"keys hold {keys.shape[1]} positions; tiles need {span} "
                             f"(capacity must be a multiple of {TILE})")
        # Rows: for each KV head, its `rep` query heads for each query: [kv_heads, n * rep, d].
        rows = queries.reshape(n, kv_heads, rep, head_dim).permute(1, 0, 2, 3)
        rows = rows.reshape(kv_heads, n * rep, head_dim)
        row_positions = positions.repeat_interleave(rep)
        num_rows = n * rep
        if padded_row_count(num_rows) > num_rows:
            pad = padded_row_count(num_rows) - num_rows
            rows = torch.cat([rows, rows.new_zeros(kv_heads, pad, head_dim)], dim=1)
            row_positions = torch.cat([row_positions, row_positions.new_zeros(pad)])
        padded_rows = rows.shape[1]
        # Scores [kv_heads, rows, span]: a reduction over head_dim only. NOTE: one product over
        # the whole span gave the same bits as one per tile here (the probe re-checks it).
        scores = torch.matmul(rows, keys[:, :span].transpose(-1, -2))
        hidden = torch.arange(span, device=keys.device) > row_positions.reshape(-1, 1)
        scores.masked_fill_(hidden, float("-inf"))
        scores.sub_(scores.amax(dim=-1, keepdim=True))
        weights = scores.exp_().view(kv_heads, padded_rows, num_tiles, TILE)
        # Per tile: weighted values [kv_heads, tiles, rows, d] (exactly TILE keys each) and the
        # tile's weight sum [kv_heads, tiles, rows, 1].
        tile_weights = weights.transpose(1, 2)
        partial = torch.matmul(tile_weights, values[:, :span].view(kv_heads, num_tiles, TILE,
                                                                   head_dim))
        partial_sum = tile_weights.sum(dim=-1, keepdim=True)
        numerator, denominator = partial[:, 0], partial_sum[:, 0]
        for tile in range(1, num_tiles):  # in increasing position order, always
            numerator = numerator + partial[:, tile]
            denominator = denominator + partial_sum[:, tile]
        attended = (numerator / denominator)[:, :num_rows]  # [kv_heads, n * rep, d]
        attended = attended.reshape(kv_heads, n, rep, head_dim).permute(1, 0, 2, 3)
        return attended.reshape(n, num_heads, head_dim)


def attention_for(device: torch.device) -> SequenceAttention:
    """The attention implementation for ``device`` (each held to the invariance contract).

    NOTE: CUDA has no kernel of its own yet; the tiled torch implementation runs there too, and
    the start-up probe decides whether it is invariant on that device.
    """
    return TiledAttention()
