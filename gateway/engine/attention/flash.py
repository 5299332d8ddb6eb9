"""Attention through torch's CPU flash kernel, called only in shapes that keep a row's bits.

Why: the tiled attention (``gateway.engine.attention.tiled.TiledAttention``) builds its scores with
whole-tensor operations, each a pass over memory; torch's fused CPU kernel
(``scaled_dot_product_attention``, flash backend) keeps them in cache. Measured on this 2-core
CPU for SmolLM2's heads (9 query heads, 3 KV heads, head_dim 64), per layer: 93 queries over
1,800 keys 6.5 ms (tiled 13.7), 1,200 queries one-shot 37 ms (69), one decode row over 1,800
keys 0.32 ms (1.35).

What the kernel computes for a query row depends on the shapes it is called with, so the calls
are fixed:

- **Keys in blocks of ``KEY_BLOCK`` (512)**: the kernel walks keys in blocks of
  ``min(512, number of keys)`` with an online softmax, and a product's reduction order depends on
  its length. Every call passes a multiple of 512 keys (enough to cover its queries), so every
  block is full. Blocks past a query's position are masked whole: they rescale its running sums
  by exp(0) = 1 and add exact zeros, so how many there are changes nothing.
- **Queries in blocks of ``QUERY_BLOCK`` (32)**: the kernel splits queries in blocks of 32 when
  it gets fewer than 192, and its products give a row different bits when its block has fewer
  than four rows. Every call of a prefill chunk gets at most ``QUERY_CALL`` (128) queries, padded
  with zero queries to a multiple of 32, so every block has exactly 32 rows.

So a prefill row's numbers are the same however its prompt was chunked, and whatever else is in
the step (each sequence is its own call). A decode row (``AttentionItem.is_decode``) is called
alone: unpadded, its numbers are its own, not a prefill's; with ``decode_as_prefill`` it is
padded with zero queries to ``DECODE_QUERIES`` (4), the fewest rows whose block gives a row the
bits a block of 32 gives, so that its numbers are a prefill's -- what the forward wants when its
projections treat decode rows as prefill rows too (``gateway.engine.linear.row_products``). One
decode row over 1,800 keys of SmolLM2 costs ~0.42 ms per layer padded, ~0.21 ms unpadded. The
start-up
probe (``gateway.engine.parity.probe``) checks all of this on the real weights; if a torch build
computes otherwise, the engine serves on the serial route.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gateway.engine.attention.tiled import AttentionItem

KEY_BLOCK = 512
"""Keys per block of the kernel's walk; every call passes a multiple of it."""

QUERY_BLOCK = 32
"""Queries per block of the kernel's split below 192 queries; calls are padded to a multiple."""

DECODE_QUERIES = 4
"""Queries a decode call is padded to with ``decode_as_prefill`` (blocks of 1-3 rows give a row
other bits than blocks of 32; 4 does not)."""

QUERY_CALL = 128
"""Prefill queries per call at most: below 192, so the kernel keeps blocks of ``QUERY_BLOCK``."""

NUMERICS = f"f{KEY_BLOCK}q{QUERY_BLOCK}"
"""This attention's part of the block namespace (see
``gateway.engine.attention.tiled.NUMERICS``)."""

WINDOW_PROBLEM = ("torch's flash kernel takes no sliding window, no scale of its own and no "
                  "logit soft-cap here")
"""Why a model with sliding-window layers, scores scaled otherwise than by head_dim ** -0.5, or
soft-capped scores, never runs this attention (route search: not tried)."""

SINKS_PROBLEM = "torch's flash kernel takes no attention sinks"
"""Why a model whose attention has sinks (gpt-oss) never runs this attention: its softmax has no
extra column for them (route search: not tried)."""


class FlashBlockAttention:
    """Each sequence's attention through the CPU flash kernel, in fixed-shape calls.

    Args:
        decode_as_prefill: pad each decode row's call so that its numbers are a prefill's.

    Raises (from ``attend``):
        ValueError: a sequence's buffers hold fewer key positions than its calls need (capacity
            must be a multiple of ``KEY_BLOCK``; ``KVSequence`` allocates so).
    """

    numerics = NUMERICS

    def __init__(self, *, decode_as_prefill: bool = False) -> None:
        self._decode_queries = DECODE_QUERIES if decode_as_prefill else 1

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        if any(item.window is not None or item.scale is not None or item.softcap is not None
               for item in items):
            raise ValueError(f"{WINDOW_PROBLEM}: choose another attention for such a model")
        if any(item.sinks is not None for item in items):
            raise ValueError(f"{SINKS_PROBLEM}: choose another attention for such a model")
        return [self._decode(item) if item.is_decode else self._prefill(item)
                for item in items]

    def _prefill(self, item: AttentionItem) -> torch.Tensor:
        queries, positions = item.queries, item.positions
        keys, values = item.kv.keys(), item.kv.values()
        n, num_heads, head_dim = queries.shape
        out = torch.empty_like(queries)
        for start in range(0, n, QUERY_CALL):
            end = min(n, start + QUERY_CALL)
            count = end - start
            padded = -(-count // QUERY_BLOCK) * QUERY_BLOCK
            call_queries = queries[start:end]
            call_positions = positions[start:end]
            if padded > count:
                call_queries = torch.cat([call_queries, call_queries.new_zeros(
                    padded - count, num_heads, head_dim)])
                call_positions = torch.cat([call_positions, call_positions[-1:].expand(
                    padded - count)])
            out[start:end] = _call(call_queries, keys, values, call_positions)[:count]
        return out

    def _decode(self, item: AttentionItem) -> torch.Tensor:
        queries, positions = item.queries, item.positions
        num_pad = self._decode_queries - queries.shape[0]
        if num_pad > 0:
            queries = torch.cat([queries, queries.new_zeros(num_pad, *queries.shape[1:])])
            positions = positions[-1:].expand(self._decode_queries)
        return _call(queries, item.kv.keys(), item.kv.values(),
                     positions)[:item.queries.shape[0]]


def _call(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
          positions: torch.Tensor) -> torch.Tensor:
    """``queries`` ``[n, heads, d]`` over the keys up to each one's position, in one kernel call
    over a multiple of ``KEY_BLOCK`` keys."""
    num_keys = (int(positions.max()) // KEY_BLOCK + 1) * KEY_BLOCK
    if num_keys > keys.shape[1]:
        raise ValueError(f"keys hold {keys.shape[1]} positions; the call needs {num_keys} "
                         f"(capacity must be a multiple of {KEY_BLOCK})")
    hidden = torch.arange(num_keys, device=keys.device) > positions.unsqueeze(1)
    mask = torch.zeros(hidden.shape, dtype=queries.dtype, device=keys.device)
    mask.masked_fill_(hidden, float("-inf"))
    # NOTE: the kernel's op itself, not scaled_dot_product_attention under sdpa_kernel(): that
    # context sets process-wide backend flags, which another thread's attention would then see.
    attended, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        queries.transpose(0, 1).unsqueeze(0), keys[:, :num_keys].unsqueeze(0),
        values[:, :num_keys].unsqueeze(0), 0.0, False, attn_mask=mask[None, None])
    out: torch.Tensor = attended[0].transpose(0, 1)
    return out


def flash_kernel_problem(device: torch.device) -> str | None:
    """Why ``FlashBlockAttention`` cannot run on ``device`` here, or None."""
    if device.type != "cpu":
        return f"the fixed-shape flash calls are measured for the CPU kernel, not {device.type}"
    try:
        item = AttentionItem.of(torch.zeros(1, 2, 8), torch.zeros(1, KEY_BLOCK, 8),
                                torch.zeros(1, KEY_BLOCK, 8), torch.zeros(1, dtype=torch.long),
                                is_decode=True)
        FlashBlockAttention().attend([item])
    except (AttributeError, RuntimeError) as exc:  # no such kernel in this build of torch
        return f"torch's flash attention kernel is unavailable: {exc}"
    return None
