"""Attention whose numbers for a token depend only on that token's own sequence.

Why own the attention (docs/design.md, "Parity"): torch's SDPA and a plain matmul-softmax give a
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
  and the tiles are combined along a binary tree over tile indices (``fold_tile_sum``), so
  extra all-zero tiles at the end add exact zeros and change nothing;
- a layer's attention sinks (gpt-oss: one logit per query head, a key with no value) enter the
  row's maximum, and the sink's weight is added to the row's folded weight sum: one more
  operation that the row's own numbers fix.

NOTE: a matmul row's bits depend on how many rows share the product when there are few: on this
CPU build (torch 2.13, measured for every shape of SmolLM2 and the tiny test Llama) M = 4, 8
and every M >= 12 give the same bits, while M = 1-3, 5-7 and 9-11 each give others. Every
product here and in ``gateway.engine.forward.batched`` is padded to such a row count
(``padded_row_count``). Whether
all of this holds on a given machine is not assumed: ``gateway.engine.parity.probe`` checks it on
the real weights at start-up, and the engine falls back to the serial exact route where it fails.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gateway.engine.attention.softcap import soft_cap_
from gateway.engine.kv.sequence import CAPACITY_ALIGNMENT
from gateway.engine.linear.row_padding import CPU_ROW_PADDING

TILE = 64
"""Key positions per tile: the fixed length of every reduction over keys."""


def padded_row_count(num_rows: int) -> int:
    """The row count to pad a product of ``num_rows`` (>= 1) rows to on the CPU (4, 8, or any
    count from 12): ``gateway.engine.linear.row_padding.CPU_ROW_PADDING``."""
    return CPU_ROW_PADDING.rows_for(num_rows)

EXP_FLOOR = -80.0
"""Scores more than this below a row's maximum weigh exp(-80) ~ 2e-35 instead of less: a change
far below float32's resolution of the row's sum, and it keeps exp off its slow underflow path."""

if CAPACITY_ALIGNMENT % TILE:
    raise AssertionError("KV buffers must hold whole tiles: CAPACITY_ALIGNMENT % TILE != 0")

NUMERICS = f"t{TILE}f"
"""This attention's part of the block namespace: tiles of TILE keys, folded combination. Any
change to the numbers it produces must change this name, so old cached K/V is never mixed in."""

FEW_QUERIES = 4
"""Items with up to this many queries (decode rows, short chunks) are attended together."""

QUERY_GROUP = 256
"""Query positions attended at once in a long chunk (bounds the scores' memory)."""


class LayerKV(Protocol):
    """One layer's K and V of one sequence, as an attention reads them.

    A paged sequence (``gateway.engine.kv.sequence.LayerPages``) can be read in place through
    its block table or gathered into contiguous tensors; an attention takes what it needs.
    """

    def keys(self) -> torch.Tensor:
        """``[kv_heads, capacity, head_dim]``; positions up to the item's last hold its keys
        (RoPE applied), the rest is finite (zeros or stale)."""
        ...

    def values(self) -> torch.Tensor:
        """Like ``keys``."""
        ...


@dataclass(frozen=True, slots=True)
class ContiguousKV:
    """K and V already in contiguous tensors (tests, oracles, the probe's own buffers)."""

    key_tensor: torch.Tensor
    value_tensor: torch.Tensor

    def keys(self) -> torch.Tensor:
        return self.key_tensor

    def values(self) -> torch.Tensor:
        return self.value_tensor


@dataclass(frozen=True, slots=True)
class AttentionItem:
    """One sequence's part of a step's attention.

    Attributes:
        queries: the new tokens' queries ``[n, heads, head_dim]`` (RoPE applied).
        kv: the sequence's K and V of this layer.
        positions: the absolute position of each query, ``[n]``.
        is_decode: one query, a sampled token fed back: its numbers need only be its own (the
            same whatever else is attended), not those a prefill of the token would give.
        first_position: where the forward knows it on the host, ``positions[0]``, the
            queries then being consecutive positions from it (an attention that plans its
            launch on the host reads it instead of the device tensor); None elsewhere.
        window: the layer's sliding window: a query at position p attends keys
            p - window < k <= p only (the keys before weigh exactly 0); None: every key up to p.
        scale: what the scores are multiplied by; None: ``head_dim ** -0.5``.
        softcap: the layer's logit soft-cap: each scaled score ``s`` weighs as
            ``softcap * tanh(s / softcap)`` (Gemma 2); None: as it is.
        sinks: the layer's attention sinks, one logit per query head ``[heads]`` (gpt-oss's
            ``self_attn.sinks``): each joins its head's softmax denominator as a key with no
            value, so a row's weights sum to less than one; None: no sinks. The items of one
            layer share them (``shared_sinks``).
    """

    queries: torch.Tensor
    kv: LayerKV
    positions: torch.Tensor
    is_decode: bool = False
    first_position: int | None = None
    window: int | None = None
    scale: float | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def score_scale(self) -> float:
        """The scores' factor: ``scale``, or ``head_dim ** -0.5``."""
        if self.scale is not None:
            return self.scale
        return 1.0 / math.sqrt(int(self.queries.shape[-1]))

    @classmethod
    def of(cls, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           positions: torch.Tensor, *, is_decode: bool = False, window: int | None = None,
           scale: float | None = None, softcap: float | None = None,
           sinks: torch.Tensor | None = None) -> AttentionItem:
        """An item over contiguous K and V ``[kv_heads, capacity, head_dim]``."""
        return cls(queries, ContiguousKV(keys, values), positions, is_decode, window=window,
                   scale=scale, softcap=softcap, sinks=sinks)


def shared_sinks(items: Sequence[AttentionItem]) -> torch.Tensor | None:
    """The sinks every item of one layer's attention carries (one tensor, or None for all).

    Raises:
        ValueError: the items carry different sinks (they are one layer's: they share them).
    """
    sinks = items[0].sinks if items else None
    if any(item.sinks is not sinks for item in items):
        raise ValueError("the items of one layer's attention share its sinks")
    return sinks


class SequenceAttention(Protocol):
    """Attention of each sequence's new queries over its own keys (one implementation per
    device), for all the sequences of a step at once.

    Every implementation keeps the invariance contract: the output row of a query depends only
    on that query, its position and its own sequence's keys/values at positions up to it --
    never on the other items, nor on how many queries its item has.

    Attributes:
        numerics: the implementation's part of the block namespace: K/V computed through
            another implementation (other numbers) are never mixed in.
    """

    numerics: str

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        """Per item, its queries attended: ``[n, heads, head_dim]``."""
        ...


class TiledAttention:
    """The CPU implementation: fixed tiles, exact max, a fixed folded combination of tiles.

    Items with few queries (decode rows) are attended together, one vectorised pass over all
    of them (a decode step of 8 sequences would otherwise run ~40 small tensor operations per
    sequence and layer); items with many go one by one in groups of ``QUERY_GROUP`` queries.
    Both paths apply the same operations to each row, so a row's bits do not depend on which
    path it took (the start-up probe checks this too: decode beside others vs prefill alone).
    """

    numerics = NUMERICS

    def __call__(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """One sequence's attention (``attend`` of one item)."""
        return self.attend([AttentionItem.of(queries, keys, values, positions)])[0]

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * len(items)
        few: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            n = item.queries.shape[0]
            if n <= FEW_QUERIES:
                few.setdefault(n, []).append(index)
            else:
                out[index] = self._one(item)
        for indices in few.values():
            for index, attended in zip(indices, self._together([items[i] for i in indices]),
                                       strict=True):
                out[index] = attended
        return [attended for attended in out if attended is not None]

    def _one(self, item: AttentionItem) -> torch.Tensor:
        queries = item.queries
        keys, values = item.kv.keys(), item.kv.values()
        n, num_heads, head_dim = queries.shape
        rep = num_heads // keys.shape[0]
        out = torch.empty_like(queries)
        scale = item.score_scale
        for start in range(0, n, QUERY_GROUP):
            end = min(n, start + QUERY_GROUP)
            out[start:end] = self._group(queries[start:end] * scale, keys, values,
                                         item.positions[start:end], rep, item.window,
                                         item.softcap, item.sinks)
        return out

    @staticmethod
    def _group(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               positions: torch.Tensor, rep: int, window: int | None = None,
               softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        n, num_heads, head_dim = queries.shape
        kv_heads = keys.shape[0]
        num_tiles = _num_tiles(positions, keys)
        span = num_tiles * TILE
        rows, row_positions = _rows(queries, positions, kv_heads)
        # Scores [kv_heads, rows, span]: a reduction over head_dim only. NOTE: one product over
        # the whole span gave the same bits as one per tile here (the probe re-checks it).
        scores = soft_cap_(torch.matmul(rows, keys[:, :span].transpose(-1, -2)), softcap)
        # Only the tiles from the group's first query on can hold a later key: mask that band
        # (with a window, every key: those before a row's window are hidden too).
        first = 0 if window is not None else int(positions.min()) // TILE * TILE
        sink_weights = _weigh(scores[:, :, first:], scores,
                              _hidden(torch.arange(first, span, device=keys.device),
                                      row_positions.reshape(-1, 1), window),
                              _row_sinks(sinks, kv_heads, n, rows.shape[1], scores.dtype))
        weights = scores.view(kv_heads, rows.shape[1], num_tiles, TILE)
        tile_values = values[:, :span].view(kv_heads, num_tiles, TILE, head_dim)
        # Per tile: weighted values [kv_heads, tiles, rows, d] (exactly TILE keys each); one
        # product per KV head reads the weights in place (strided) instead of copying them into
        # tile-major order (the same bits as the copying product: the probe checks it).
        width = _tree_width(num_tiles)
        partial = scores.new_empty(kv_heads, width, rows.shape[1], head_dim + 1)
        partial[:, num_tiles:] = 0
        for head in range(kv_heads):
            torch.bmm(weights[head].transpose(0, 1), tile_values[head],
                      out=partial[head, :num_tiles, :, :head_dim])
        # The tile's weight sum rides along as one more column [kv_heads, tiles, rows].
        partial[:, :num_tiles, :, head_dim] = weights.sum(dim=-1).transpose(1, 2)
        summed = fold_tile_sum(partial, dim=1)
        return _combine(summed[..., :head_dim], _with_sinks(summed[..., head_dim:], sink_weights),
                        n, rep)

    @staticmethod
    def _together(items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        """Items of the same (small) query count, each row through ``_group``'s operations."""
        first_item = items[0]
        keys = [item.kv.keys() for item in items]
        values = [item.kv.values() for item in items]
        n, num_heads, head_dim = first_item.queries.shape
        kv_heads = keys[0].shape[0]
        rep = num_heads // kv_heads
        count = len(items)
        tiles = [_num_tiles(item.positions, item_keys)
                 for item, item_keys in zip(items, keys, strict=True)]
        max_tiles = max(tiles)
        scales = {item.score_scale for item in items}
        if len(scales) > 1:
            raise ValueError("the items of one layer's attention share its scale")
        queries = torch.stack([item.queries for item in items]) * scales.pop()
        rows, row_positions = _rows(queries.reshape(count * n, num_heads, head_dim),
                                    torch.cat([item.positions for item in items]), kv_heads,
                                    items=count)
        padded_rows = rows.shape[2]
        scores = keys[0].new_zeros(count, kv_heads, padded_rows, max_tiles * TILE)
        for b in range(count):
            span = tiles[b] * TILE
            scores[b, :, :, :span] = torch.matmul(rows[b], keys[b][:, :span].transpose(-1, -2))
        windows = {item.window for item in items}
        if len(windows) > 1:
            raise ValueError("the items of one layer's attention share its window")
        softcaps = {item.softcap for item in items}
        if len(softcaps) > 1:
            raise ValueError("the items of one layer's attention share its soft-cap")
        soft_cap_(scores, softcaps.pop())
        hidden = _hidden(torch.arange(max_tiles * TILE, device=scores.device),
                         row_positions.unsqueeze(-1), windows.pop()
                         ).unsqueeze(1)  # [items, 1, rows, span]
        sinks = _row_sinks(shared_sinks(items), kv_heads, n, padded_rows, scores.dtype)
        sink_weights = _weigh(scores, scores, hidden, None if sinks is None else sinks[None])
        weights = scores.view(count, kv_heads, padded_rows, max_tiles, TILE)
        partial = scores.new_zeros(count, kv_heads, _tree_width(max_tiles), padded_rows,
                                   head_dim + 1)
        for b in range(count):
            used = tiles[b]
            tile_values = values[b][:, :used * TILE].view(kv_heads, used, TILE, head_dim)
            partial[b, :, :used, :, :head_dim] = torch.matmul(
                weights[b, :, :, :used].transpose(1, 2), tile_values)
        partial[:, :, :max_tiles, :, head_dim] = weights.sum(dim=-1).transpose(2, 3)
        summed = fold_tile_sum(partial, dim=2)
        attended = _combine(summed[..., :head_dim],
                            _with_sinks(summed[..., head_dim:], sink_weights), n,
                            rep)  # [items, n, heads, d]
        return list(attended.unbind(0))


def _num_tiles(positions: torch.Tensor, keys: torch.Tensor) -> int:
    num_tiles = int(positions.max()) // TILE + 1
    if num_tiles * TILE > keys.shape[1]:
        raise ValueError(f"keys hold {keys.shape[1]} positions; tiles need {num_tiles * TILE} "
                         f"(capacity must be a multiple of {TILE})")
    return num_tiles


def _rows(queries: torch.Tensor, positions: torch.Tensor, kv_heads: int, *,
          items: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head, its query heads' rows ``[kv_heads, rows, d]`` padded to
    ``padded_row_count``, and each row's position ``[rows]``. With ``items``, ``queries`` holds
    that many items' queries one after the other, and both get a leading items dimension."""
    total, num_heads, head_dim = queries.shape
    groups = items or 1
    n = total // groups
    rep = num_heads // kv_heads
    rows = queries.reshape(groups, n, kv_heads, rep, head_dim).permute(0, 2, 1, 3, 4)
    rows = rows.reshape(groups, kv_heads, n * rep, head_dim)
    row_positions = positions.reshape(groups, n).repeat_interleave(rep, dim=1)
    num_rows = n * rep
    if padded_row_count(num_rows) > num_rows:
        pad = padded_row_count(num_rows) - num_rows
        rows = torch.cat([rows, rows.new_zeros(groups, kv_heads, pad, head_dim)], dim=2)
        row_positions = torch.cat([row_positions, row_positions.new_zeros(groups, pad)], dim=1)
    if items is None:
        return rows[0], row_positions[0]
    return rows, row_positions


def _hidden(keys: torch.Tensor, rows: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which key positions ``keys`` each row position ``rows`` (broadcast) may not see: those
    after it, and with a ``window``, those at or before ``row - window``. A row always sees its
    own position, so its maximum is finite."""
    hidden = keys > rows
    if window is not None:
        hidden |= keys <= rows - window
    return hidden


def _weigh(band: torch.Tensor, scores: torch.Tensor, hidden: torch.Tensor,
           sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Turn ``scores`` into unnormalised softmax weights in place; ``band`` is the part of it
    that ``hidden`` (broadcast over it) says may hold keys after the query. With ``sinks`` (one
    logit per row, ``[..., rows, 1]``), the maximum is over the scores and the row's sink, as
    transformers takes it, and the sink's own weight is returned (``_with_sinks``)."""
    band.masked_fill_(hidden, float("-inf"))
    peak = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        peak = torch.maximum(peak, sinks)
    scores.sub_(peak)
    # exp of a score far below the max is slow on CPU (its special-case path for results that
    # underflow runs ~5x slower); clamping first keeps every exp on the fast path, and hidden
    # keys are zeroed after.
    scores.clamp_(min=EXP_FLOOR).exp_()
    band.masked_fill_(hidden, 0.0)
    return None if sinks is None else (sinks - peak).clamp_(min=EXP_FLOOR).exp_()


def _row_sinks(sinks: torch.Tensor | None, kv_heads: int, n: int, num_rows: int,
               dtype: torch.dtype) -> torch.Tensor | None:
    """Each row's sink ``[kv_heads, num_rows, 1]`` in ``_rows``' order (a KV head's rows are
    its positions, each with its ``rep`` query heads), padding rows given 0 (dropped after)."""
    if sinks is None:
        return None
    rep = sinks.shape[0] // kv_heads
    per_row = sinks.to(dtype).reshape(kv_heads, 1, rep).expand(kv_heads, n, rep)
    out = per_row.new_zeros(kv_heads, num_rows, 1)
    out[:, :n * rep, 0] = per_row.reshape(kv_heads, n * rep)
    return out


def _with_sinks(denominator: torch.Tensor, sink_weights: torch.Tensor | None) -> torch.Tensor:
    """The rows' weight sums with their sinks' weights added (after every tile's: one addition
    a row's own numbers fix)."""
    return denominator if sink_weights is None else denominator + sink_weights


def _combine(numerator: torch.Tensor, denominator: torch.Tensor, n: int,
             rep: int) -> torch.Tensor:
    """``[..., kv_heads, rows, d]`` sums back to ``[..., n, heads, d]`` attended queries."""
    *lead, kv_heads, _, head_dim = numerator.shape
    attended = (numerator / denominator)[..., :n * rep, :]
    attended = attended.reshape(*lead, kv_heads, n, rep, head_dim).transpose(-4, -3)
    return attended.reshape(*lead, n, kv_heads * rep, head_dim)


def _tree_width(num_tiles: int) -> int:
    """The power of two at or above ``num_tiles``: the width ``fold_tile_sum`` folds."""
    return 1 << max(0, num_tiles - 1).bit_length()


def fold_tile_sum(partial: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``partial`` over its tile dimension ``dim`` (a power of two wide, zero past the last
    tile) by folding it in half until one tile is left, in place.

    Why this order: tile i is added to tile i + width/2, then to i + width/4, ... -- a binary
    tree fixed by tile indices alone. The tiles a longer chunk brings in (keys after the query,
    weight exactly 0) and a wider power of two only fold exact zeros into the same tree, so a
    query's sum is the same whatever the chunk; and it takes log2(width) vectorised additions on
    views, without copies (a row-by-row sequential sum took one operation per tile).
    """
    width = partial.shape[dim]
    if width & (width - 1):
        raise ValueError(f"the tile dimension must be a power of two wide, got {width}")
    while width > 1:
        width //= 2
        partial.narrow(dim, 0, width).add_(partial.narrow(dim, width, width))
    return partial.select(dim, 0)
