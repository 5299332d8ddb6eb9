"""A recurrent layer's state at the end of each block, kept in that block's own pages.

Why in the pages: a block's payload is every layer's K/V slots for its tokens, and every tier
(device pages, host, disk, Redis) already stores, verifies (the block MAC), counts and evicts
exactly that. A recurrent layer writes no K/V, so its slots in a block are free: its state at
the block's end goes there, and a cached block carries it wherever the block goes -- one
payload under one MAC, bytes and quotas as before. A warm start then reads the state of the
last block of its match, and the sequence goes on from it with the bits a cold prefill would
have had (the layer's arithmetic gives the same state however the tokens arrived,
``gateway.engine.forward.recurrent``).

Where a state is larger than its layer's slots (the scans' matrices of Gated DeltaNet and
Mamba-2: often several times a block's K/V of one layer), the cache's layout gains extra layers
after the model's own (``cache_layout``), written by nothing but states: layer ``i``'s state
fills its own slots and then whole extra layers of its own (``StateHome.layers``). So a block
of a hybrid is larger than a dense model's (docs/families.md, "Hybrid models"), and still one
payload that every tier moves and checks as it is.

The layout: the state's parts (its convolution window, then its scan's state) become one run
of numbers in the layout's dtype, zero-padded to whole positions, each position's K numbers then
its V numbers (``[kv_heads, head_dim]`` each), filling its layers' positions in order; every
other position of those layers is zero (the forward writes zeros there each step), so a block
holds nothing but what it computed. A part in the layout's dtype is laid as it is; a part in
another (a scan's float32 state in a 16-bit model) is laid byte by byte, each byte a number
0..255, which every float dtype holds exactly and none reads as a NaN -- so a kept state
compares, copies and verifies like any K/V, and reads back with its bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from gateway.engine.forward.recurrent.chunked_scan import ScanStream
from gateway.engine.forward.recurrent.layer_state import RecurrentState
from gateway.engine.forward.recurrent.mixers import RECURRENT_MIXERS
from gateway.engine.forward.recurrent.short_conv import ConvWindow
from tiers.payload import KVLayout

SCAN_DTYPE = torch.float32
"""What a scan's state is kept in (what ``chunked_scan`` computes it in)."""

ReadSlots = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``read(layer, rows)``: a block's first ``rows`` positions of ``layer``, K and V
``[kv_heads, rows, head_dim]`` each."""


@dataclass(frozen=True, slots=True)
class StatePiece:
    """What one layer of a block holds of a state: its first ``rows`` positions' K and V
    ``[kv_heads, rows, head_dim]``."""

    layer: int
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.keys.shape[1])


@dataclass(frozen=True, slots=True)
class StateHome:
    """Where one recurrent layer's state lies in each block it ends.

    Attributes:
        window: the shape of its convolution window ``[kernel - 1, channels]`` (in the
            layout's dtype).
        scan: the shape of its scan's state ``[heads, key_dim, value_dim]`` (float32); None:
            a layer without a scan (LFM2's).
        layers: the layers whose positions it fills, in order: its own, then extra ones.
        layout: the model's K/V layout (a position's numbers: ``2 * kv_heads * head_dim``).
        block_tokens: positions a block has in each layer.
    """

    window: tuple[int, int]
    scan: tuple[int, int, int] | None
    layers: tuple[int, ...]
    layout: KVLayout
    block_tokens: int

    @property
    def row_width(self) -> int:
        """Numbers one position of a layer holds: its K and its V."""
        return 2 * self.layout.kv_heads * self.layout.head_dim

    @property
    def numbers(self) -> int:
        """Numbers of the layout's dtype the state takes."""
        return _numbers(self.window, self.scan, self.layout.dtype)

    @property
    def rows(self) -> int:
        """Positions the state fills, over all its layers."""
        return -(-self.numbers // self.row_width)

    def pieces(self, state: RecurrentState) -> list[StatePiece]:
        """``state`` laid into its layers' first positions (the last layer partly filled)."""
        laid = self._laid(state)
        padded = torch.cat([laid, laid.new_zeros(self.rows * self.row_width - laid.numel())])
        kv = self.layout.kv_heads, self.layout.head_dim
        out = []
        for layer, start, end in self._spans():
            rows = padded[start * self.row_width:end * self.row_width].view(end - start, 2, *kv)
            out.append(StatePiece(layer, rows[:, 0].transpose(0, 1), rows[:, 1].transpose(0, 1)))
        return out

    def state(self, read: ReadSlots, position: int) -> RecurrentState:
        """The state laid by ``pieces``, read back from a block that ends at ``position``:
        fresh tensors, never views of the pages."""
        parts = []
        for layer, start, end in self._spans():
            keys, values = read(layer, end - start)
            parts.append(torch.stack([keys.transpose(0, 1), values.transpose(0, 1)], dim=1)
                         .reshape(-1))
        laid = torch.cat(parts)[:self.numbers]
        dtype = self.layout.dtype
        window_numel = math.prod(self.window)
        window = ConvWindow(laid[:window_numel].reshape(self.window).clone())
        if self.scan is None:
            return RecurrentState(window)
        scan = _unlaid(laid[window_numel:], SCAN_DTYPE, dtype).reshape(self.scan).clone()
        return RecurrentState(window, ScanStream.at(scan, position))

    def _laid(self, state: RecurrentState) -> torch.Tensor:
        dtype = self.layout.dtype
        inputs = state.conv.inputs
        if tuple(inputs.shape) != self.window or inputs.dtype != dtype:
            raise ValueError(f"a convolution window of {tuple(inputs.shape)} in {inputs.dtype}, "
                             f"expected {self.window} in {dtype}")
        parts = [inputs.reshape(-1)]
        if (self.scan is None) != (state.scan is None):
            raise ValueError("a state with a scan where its layer has none, or none where it has")
        if state.scan is not None:
            if state.scan.waiting.num_tokens:
                raise ValueError(f"a scan at {state.scan.length} has "
                                 f"{state.scan.waiting.num_tokens} tokens past its last whole "
                                 "chunk: a block's end is a chunk's end")
            scan = state.scan.state
            if tuple(scan.shape) != self.scan or scan.dtype != SCAN_DTYPE:
                raise ValueError(f"a scan's state of {tuple(scan.shape)} in {scan.dtype}, "
                                 f"expected {self.scan} in {SCAN_DTYPE}")
            parts.append(_laid_as(scan.reshape(-1), dtype))
        return torch.cat(parts)

    def _spans(self) -> list[tuple[int, int, int]]:
        """(layer, first row, end row) of the state's rows in each of its layers."""
        spans = []
        for i, layer in enumerate(self.layers):
            start = i * self.block_tokens
            spans.append((layer, start, min(self.rows, start + self.block_tokens)))
        return [span for span in spans if span[2] > span[1]]


def _laid_as(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``part`` (flat) as numbers of ``dtype``: itself, or its bytes as numbers 0..255."""
    if part.dtype == dtype:
        return part
    return part.contiguous().view(torch.uint8).to(dtype)


def _unlaid(laid: torch.Tensor, dtype: torch.dtype, layout_dtype: torch.dtype) -> torch.Tensor:
    """The flat part of ``dtype`` that ``_laid_as`` laid into ``laid`` (it may run past)."""
    if dtype == layout_dtype:
        return laid
    size = torch.empty(0, dtype=dtype).element_size()
    count = laid.numel() // size * size
    return laid[:count].to(torch.uint8).view(dtype)


def _numbers(window: tuple[int, int], scan: tuple[int, int, int] | None,
             dtype: torch.dtype) -> int:
    """Numbers of ``dtype`` a state of these shapes is laid into."""
    numbers = math.prod(window)
    if scan is not None:
        scan_numel = math.prod(scan)
        numbers += (scan_numel if dtype == SCAN_DTYPE
                    else scan_numel * torch.empty(0, dtype=SCAN_DTYPE).element_size())
    return numbers


def state_homes(config: Any, mixers: Mapping[int, str], layout: KVLayout,
                block_tokens: int,
                beside_attention: frozenset[int] = frozenset()) -> dict[int, StateHome]:
    """Where each recurrent layer's state lies in blocks of ``block_tokens`` tokens.

    Args:
        config: the model's config (transformers' attribute names), which the kinds read.
        mixers: the recurrent layers' kinds (``RECURRENT_MIXERS`` names), by index.
        layout: the model's own K/V layout (``num_layers`` its decoder layers): extra layers
            are numbered after them, in the order of the layers they serve.
        block_tokens: positions a block has in each layer.
        beside_attention: recurrent layers that run beside an attention (Falcon-H1's): their
            own slots hold its K/V, so their states lie in extra layers only.

    Raises:
        ValueError: a kind no module computes.
    """
    unknown = sorted(set(mixers.values()) - set(RECURRENT_MIXERS))
    if unknown:
        raise ValueError(f"recurrent layers of kinds nothing computes: {unknown}")
    if block_tokens < 1:
        raise ValueError(f"a block holds at least one token, not {block_tokens}")
    homes: dict[int, StateHome] = {}
    next_extra = layout.num_layers
    per_layer = block_tokens * 2 * layout.kv_heads * layout.head_dim
    for index, kind in sorted(mixers.items()):
        start = RECURRENT_MIXERS[kind].start(config, "meta")
        rows, channels = start.conv.inputs.shape
        window = (int(rows), int(channels))
        scan = None
        if start.scan is not None:
            heads, key_dim, value_dim = start.scan.state.shape
            scan = (int(heads), int(key_dim), int(value_dim))
        slots = -(-_numbers(window, scan, layout.dtype) // per_layer)
        own = () if index in beside_attention else (index,)
        extra = max(slots - len(own), 0)
        layers = (*own, *range(next_extra, next_extra + extra))
        next_extra += extra
        homes[index] = StateHome(window, scan, layers, layout, block_tokens)
    return homes


def cache_layout(config: Any, mixers: Mapping[int, str], layout: KVLayout,
                 block_tokens: int,
                 beside_attention: frozenset[int] = frozenset()) -> KVLayout:
    """The cache's layout for a model whose own is ``layout``: its layers, and the extra
    layers its recurrent layers' states need in blocks of ``block_tokens`` (``state_homes``)."""
    homes = state_homes(config, mixers, layout, block_tokens, beside_attention)
    extra = sum(1 for home in homes.values() for layer in home.layers
                if layer >= layout.num_layers)
    return replace(layout, num_layers=layout.num_layers + extra) if extra else layout


def state_problem(config: Any, mixers: Mapping[int, str], layout: KVLayout,
                  block_tokens: int,
                  beside_attention: frozenset[int] = frozenset()) -> str | None:
    """Why the recurrent layers' states (``mixers``, by layer) cannot be kept in blocks of
    ``block_tokens`` tokens of ``layout`` (the cache's, extra layers included), in one line;
    None when they can."""
    own = replace(layout, num_layers=int(config.num_hidden_layers))
    try:
        homes = state_homes(config, mixers, own, block_tokens, beside_attention)
    except ValueError as exc:
        return str(exc)
    needed = max((max(home.layers) + 1 for home in homes.values()), default=0)
    if needed > layout.num_layers:
        return (f"its recurrent layers' states need {needed} layers of a block of "
                f"{block_tokens} tokens, and the cache's layout has {layout.num_layers}: the "
                "model was loaded for blocks of another size (cache.block_tokens)")
    return None


def state_bytes(states: Mapping[int, object]) -> int:
    """Bytes the recurrent layers' ``states`` (by index) hold: windows, scans' states and the
    tokens a scan holds past its last whole chunk."""
    total = 0
    for state in states.values():
        if not isinstance(state, RecurrentState):
            raise TypeError(f"a recurrent layer's state, not {type(state).__name__}")
        tensors = [state.conv.inputs]
        if state.scan is not None:
            waiting = state.scan.waiting
            tensors += [state.scan.state, waiting.queries, waiting.keys, waiting.values,
                        waiting.decays, waiting.betas]
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
