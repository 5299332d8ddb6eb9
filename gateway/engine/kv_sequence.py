"""A request's own KV buffers: cached prefix blocks copied in, new tokens written in place.

Why preallocate: growing a cache by concatenation re-copies the whole context on every decode
step; one buffer per layer sized for prefix + suffix + max new tokens is filled in place instead
(copying into an existing tensor ran at 23.5 GB/s here against 9.2 GB/s for a fresh clone).

Why copy the prefix at all (copy-on-write): cached blocks are shared by every request that
reads them. A request only ever writes into its own buffers, so concurrent requests extending
the same shared prefix can never see each other's tokens, and stored KV can never be changed by
a request. Blocks handed back for storage are fresh contiguous copies, never views of a buffer
that keeps being written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gateway.engine.attention import CAPACITY_ALIGNMENT
from tiers.payload import KVBlock, KVLayout


class KVSequence:
    """Per-layer K and V buffers of shape ``[kv_heads, capacity, head_dim]``.

    Args:
        layout: the model's KV layout.
        capacity: the most tokens this request can hold (prompt + max new tokens).
        device: where the buffers live (where the model runs).
    """

    def __init__(
        self, layout: KVLayout, capacity: int, *, device: torch.device | str = "cpu",
        zeroed_from: int = 0,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        # NOTE: buffers are rounded up to whole attention tiles and zeroed: tiled attention reads
        # whole tiles and weighs the positions after the query by exactly 0, which needs them
        # finite (uninitialised memory can hold NaN, and 0 * NaN is NaN).
        allocated = -(-capacity // CAPACITY_ALIGNMENT) * CAPACITY_ALIGNMENT
        shape = (layout.kv_heads, allocated, layout.head_dim)
        self.layout = layout
        self.capacity = capacity
        # ``zeroed_from``: the caller fills the positions before it at once (``from_blocks``), so
        # only the rest is zeroed (one write of the buffers fewer).
        self._keys = [_buffer(shape, zeroed_from, layout.dtype, device)
                      for _ in range(layout.num_layers)]
        self._values = [_buffer(shape, zeroed_from, layout.dtype, device)
                        for _ in range(layout.num_layers)]
        self._length = 0

    @staticmethod
    def nbytes_for(layout: KVLayout, capacity: int) -> int:
        """The bytes of the buffers a sequence of ``capacity`` tokens allocates."""
        allocated = -(-capacity // CAPACITY_ALIGNMENT) * CAPACITY_ALIGNMENT
        return layout.bytes_per_token * allocated

    @classmethod
    def from_blocks(
        cls,
        layout: KVLayout,
        blocks: Sequence[KVBlock],
        capacity: int,
        *,
        device: torch.device | str = "cpu",
    ) -> KVSequence:
        """A new sequence holding a copy of ``blocks`` (the cached prefix) at its start."""
        held = sum(block.num_tokens for block in blocks)
        seq = cls(layout, capacity, device=device, zeroed_from=min(held, capacity))
        for block in blocks:
            n = block.num_tokens
            seq._reserve(n)
            for layer in range(layout.num_layers):
                seq._keys[layer][:, seq._length : seq._length + n].copy_(block.keys[layer])
                seq._values[layer][:, seq._length : seq._length + n].copy_(block.values[layer])
            seq._length += n
        return seq

    @classmethod
    def unallocated(cls, layout: KVLayout) -> KVSequence:
        """A sequence with no buffers and no room: a request's until its own are allocated."""
        seq = cls.__new__(cls)
        seq.layout, seq.capacity, seq._length = layout, 0, 0
        seq._keys, seq._values = [], []
        return seq

    def release(self) -> None:
        """Let go of the buffers (the request has ended): the sequence is empty and has no room
        afterwards, so a late write fails loudly instead of landing in freed memory's place."""
        self._keys, self._values = [], []
        self._length = 0
        self.capacity = 0

    @property
    def length(self) -> int:
        """Tokens whose K/V are complete in every layer."""
        return self._length

    def _reserve(self, num_tokens: int) -> None:
        if self._length + num_tokens > self.capacity:
            raise ValueError(
                f"{num_tokens} more tokens do not fit: {self._length} held, "
                f"capacity {self.capacity}"
            )

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one layer's K/V for the next ``keys.shape[1]`` tokens (after ``length``).

        Every layer must be written for the same tokens before ``advance`` makes them count.
        """
        n = int(keys.shape[1])
        self._reserve(n)
        self._keys[layer][:, self._length : self._length + n].copy_(keys)
        self._values[layer][:, self._length : self._length + n].copy_(values)

    def advance(self, num_tokens: int) -> None:
        """Count the tokens just written in every layer."""
        self._reserve(num_tokens)
        self._length += num_tokens

    def truncate(self, num_tokens: int) -> None:
        """Forget every token from ``num_tokens`` on (to recompute them, block-aligned)."""
        if not 0 <= num_tokens <= self._length:
            raise ValueError(f"cannot truncate {self._length} tokens to {num_tokens}")
        self._length = num_tokens

    def keys(self, layer: int) -> torch.Tensor:
        """View of one layer's K for the tokens held (no copy)."""
        return self._keys[layer][:, : self._length]

    def values(self, layer: int) -> torch.Tensor:
        return self._values[layer][:, : self._length]

    def key_buffer(self, layer: int) -> torch.Tensor:
        """The whole preallocated K buffer of one layer, whole attention tiles long (zeroed)."""
        return self._keys[layer]

    def value_buffer(self, layer: int) -> torch.Tensor:
        return self._values[layer]

    def block(self, index: int, block_tokens: int) -> KVBlock:
        """A fresh, contiguous copy of full block ``index``, for storage in a tier."""
        start, end = index * block_tokens, (index + 1) * block_tokens
        if end > self._length:
            raise ValueError(f"block {index} is not complete ({self._length} tokens held)")
        return self.span(start, end)

    def span(self, start: int, end: int) -> KVBlock:
        """A fresh, contiguous copy of the K/V of positions ``start`` to ``end`` (held ones)."""
        if not 0 <= start < end <= self._length:
            raise ValueError(f"positions {start}..{end} are not held ({self._length} tokens)")
        return KVBlock(
            keys=tuple(k[:, start:end].clone() for k in self._keys),
            values=tuple(v[:, start:end].clone() for v in self._values),
        )


def _buffer(shape: tuple[int, int, int], zeroed_from: int, dtype: torch.dtype,
            device: torch.device | str) -> torch.Tensor:
    """A buffer whose positions from ``zeroed_from`` on are zero (the rest is the caller's)."""
    if zeroed_from <= 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = torch.empty(shape, dtype=dtype, device=device)
    buffer[:, zeroed_from:].zero_()
    return buffer
