"""A recurrent layer's state at the end of each block, kept in that block's own pages.

Why in the pages: a block's payload is every layer's K/V slots for its tokens, and every tier
(device pages, host, disk, Redis) already stores, verifies (the block MAC), counts and evicts
exactly that. A recurrent layer writes no K/V, so its slots in a block are free: its state at
the block's end goes there, and a cached block carries it wherever the block goes -- one
payload under one MAC, bytes and quotas as before. A warm start then reads the state of the
last block of its match, and the sequence goes on from it with the bits a cold prefill would
have had (the layer's arithmetic gives the same state however the tokens arrived,
``gateway.engine.forward.recurrent``).

The layout: the state's numbers, flattened and zero-padded, fill the block's first ``rows``
positions of that layer, each position's K numbers then its V numbers (``[kv_heads,
head_dim]`` each); every other position of the layer is zero, so a block holds nothing but
what it computed. Only states that fit are kept this way -- LFM2's convolution windows, a few
tokens' inputs -- and a model whose state does not fit its blocks is refused at start-up
(``state_problem``); the scans' matrices of Gated DeltaNet and Mamba-2 are larger than a
block's K/V (docs/families.md, "Hybrid models") and need a home of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward.recurrent.layer_state import RecurrentState
from gateway.engine.forward.recurrent.short_conv import ConvWindow
from tiers.payload import KVLayout


@dataclass(frozen=True, slots=True)
class StateRows:
    """How one recurrent layer's state is laid into a block's positions of that layer.

    Attributes:
        shape: the state's convolution window ``[kernel - 1, channels]``.
        layout: the model's K/V layout (a position's numbers: ``2 * kv_heads * head_dim``).
    """

    shape: tuple[int, int]
    layout: KVLayout

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def row_width(self) -> int:
        """Numbers one position of a layer holds: its K and its V."""
        return 2 * self.layout.kv_heads * self.layout.head_dim

    @property
    def rows(self) -> int:
        """Positions of a block the state fills."""
        return -(-self.numel // self.row_width)

    def keys_values(self, state: RecurrentState) -> tuple[torch.Tensor, torch.Tensor]:
        """``state`` as the K and V ``[kv_heads, rows, head_dim]`` of the block's first
        ``rows`` positions of its layer."""
        if state.scan is not None:
            raise ValueError("a scan's state is not kept in a block's pages")
        inputs = state.conv.inputs
        if tuple(inputs.shape) != self.shape:
            raise ValueError(f"a convolution window of {tuple(inputs.shape)}, expected "
                             f"{self.shape}")
        flat = inputs.reshape(-1).to(self.layout.dtype)
        padded = torch.cat([flat, flat.new_zeros(self.rows * self.row_width - self.numel)])
        laid = padded.view(self.rows, 2, self.layout.kv_heads, self.layout.head_dim)
        return laid[:, 0].transpose(0, 1), laid[:, 1].transpose(0, 1)

    def state(self, keys: torch.Tensor, values: torch.Tensor) -> RecurrentState:
        """The state laid by ``keys_values`` (``[kv_heads, >= rows, head_dim]`` each, from the
        block's first positions): a fresh tensor, never a view of the pages."""
        laid = torch.stack([keys[:, :self.rows].transpose(0, 1),
                            values[:, :self.rows].transpose(0, 1)], dim=1)
        return RecurrentState(ConvWindow(laid.reshape(-1)[:self.numel].reshape(self.shape)
                                         .clone()))


def state_rows(config: Any, mixer: str, layout: KVLayout) -> StateRows:
    """The layout of a ``mixer``-kind layer's state in its blocks, for a model with ``config``
    (transformers' attribute names).

    Raises:
        ValueError: the kind's state is not one kept in pages (a scan's).
    """
    if mixer == "lfm2_conv":
        kernel = int(config.conv_L_cache)
        return StateRows((kernel - 1, int(config.hidden_size)), layout)
    raise ValueError(f"the state of a {mixer} layer is not kept in a block's pages (a scan's "
                     "matrices are larger than a block's K/V)")


def state_problem(config: Any, mixers: dict[int, str], layout: KVLayout,
                  block_tokens: int) -> str | None:
    """Why the recurrent layers' states (``mixers``, by layer) cannot be kept in blocks of
    ``block_tokens`` tokens, in one line; None when they can."""
    for index, mixer in sorted(mixers.items()):
        try:
            rows = state_rows(config, mixer, layout)
        except ValueError as exc:
            return f"layer {index}: {exc}"
        if rows.rows > block_tokens:
            return (f"layer {index}'s {mixer} state ({rows.numel} numbers) needs {rows.rows} "
                    f"positions of a block, and blocks hold {block_tokens}: raise "
                    "cache.block_tokens")
    return None



def window_bytes(states: Mapping[int, object]) -> int:
    """Bytes the convolution windows of ``states`` (recurrent layers' states by index) hold."""
    total = 0
    for state in states.values():
        if not isinstance(state, RecurrentState):
            raise TypeError(f"a recurrent layer's state, not {type(state).__name__}")
        total += state.conv.inputs.numel() * state.conv.inputs.element_size()
    return total
