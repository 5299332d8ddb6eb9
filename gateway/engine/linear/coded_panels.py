"""Panels kept as codes: a weight whose float32 numbers are all ``code * scale + offset``, one
scale and offset per column and block of 32 inputs, stored as its 4- or 8-bit codes; or whose
numbers are all bfloat16s, stored as those.

Why: a decode step reads every weight once, so its time is the weights' bytes. A GGUF's Q4_1 and
Q8_0 tensors -- the bundled SmolLM2's projections and embeddings -- dequantise to exactly such
numbers, and once converted to float32 they cost 32 bits a number to read where 4 or 8 (and a
scale and offset per 32) say the same bits. Likewise a bfloat16 checkpoint (most published
ones) served in float32: each number is a bfloat16, kept in its 16 bits and widened exactly.
The panel kernel expands each block in registers with the arithmetic that made the weight (a
product, exact, then a sum; or the widening) and multiplies the expanded numbers as it
multiplies whole panels (``native/panel_products.c``), so every output has the same bits as
over whole panels: the kernel's namespace part is unchanged.

Why exact by check, not by trust: the codes are found from the float32 weight itself (no GGUF
is read here), and a weight is kept coded only where expanding every code -- by torch, with the
kernel's arithmetic -- gives back every bit of the weight (zeros' signs included). Any other
weight (a float32 checkpoint's, or one trained further in float32) stays in whole panels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 32
"""Inputs sharing a scale and offset (the C kernel's ``BLOCK``; GGUF's Q4_1 and Q8_0 blocks)."""

PANEL = 16
"""Columns of a panel (``panel_products.PANEL``, repeated here to keep imports one way)."""

ROWS_AT_ONCE = 4096
"""Weight rows coded at a time: bounds the temporary memory of coding a large table."""


@dataclass(frozen=True, slots=True)
class Coding:
    """How a weight's numbers are coded: ``bits`` per code, unsigned codes over an offset (the
    block's least number; Q4_1) or signed ones about zero (Q8_0); or, ``bits`` 16, each number
    a bfloat16 (a bfloat16 checkpoint's weights served in float32), widened exactly."""

    bits: int
    signed: bool

    @property
    def is_bfloat16(self) -> bool:
        return self.bits == 16

    @property
    def codes(self) -> tuple[int, int]:
        """The least and greatest code."""
        return (-(1 << (self.bits - 1)), (1 << (self.bits - 1)) - 1) if self.signed \
            else (0, (1 << self.bits) - 1)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one panel: 16 scales, 16 offsets, then the codes (bfloat16s:
        the numbers alone)."""
        numbers = BLOCK * PANEL * self.bits // 8
        return numbers if self.is_bfloat16 else 2 * PANEL * 4 + numbers


FOUR_BITS = Coding(bits=4, signed=False)
EIGHT_BITS = Coding(bits=8, signed=True)
BFLOAT16 = Coding(bits=16, signed=True)
CODINGS = (FOUR_BITS, EIGHT_BITS, BFLOAT16)
"""Tried in order: the fewest bytes first."""


def expand(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``codes * scale + offset`` in float32, two roundings as the C kernel does them (codes
    ``[..., BLOCK]``, scale and offset ``[...]``)."""
    return codes.to(torch.float32) * scale.unsqueeze(-1) + offset.unsqueeze(-1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per block of ``[..., BLOCK]``: whether every number has the same bits (-0.0 is not 0.0)."""
    return (a.view(torch.int32) == b.view(torch.int32)).all(dim=-1)


def _neighbours(scale: torch.Tensor) -> list[torch.Tensor]:
    """``scale`` and the float16 numbers either side of it: a block's scale as a GGUF stores
    it is the float16 nearest its span / codes, which the span read back from its numbers may
    miss by one."""
    half = scale.to(torch.float16)
    up = torch.nextafter(half, torch.full_like(half, float("inf")))
    down = torch.nextafter(half, torch.full_like(half, float("-inf")))
    return [half.float(), up.float(), down.float()]


def _code_rows(blocks: torch.Tensor, coding: Coding,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes, scales and offsets for ``blocks`` ``[rows, n_blocks, BLOCK]`` (float32) that
    expand to their very bits, or None where some block has none."""
    low, high = coding.codes
    if coding.signed:
        offset = torch.zeros(blocks.shape[:-1], dtype=torch.float32)
        span = blocks.abs().amax(dim=-1) / high
    else:
        offset = blocks.amin(dim=-1)
        span = (blocks.amax(dim=-1) - offset) / high
    codes = torch.zeros(blocks.shape, dtype=torch.int16)
    scale = torch.zeros_like(offset)
    done = torch.zeros(offset.shape, dtype=torch.bool)
    for candidate in _neighbours(span):
        safe = torch.where(candidate == 0, torch.ones_like(candidate), candidate)
        trial = torch.round((blocks - offset.unsqueeze(-1)) / safe.unsqueeze(-1))
        trial = torch.where((candidate == 0).unsqueeze(-1), torch.zeros_like(trial), trial)
        trial = trial.clamp(low, high)
        fits = _same_bits(expand(trial, candidate, offset), blocks) & ~done
        codes[fits] = trial[fits].to(torch.int16)
        scale[fits] = candidate[fits]
        done |= fits
        if bool(done.all()):
            return codes, scale, offset
    return None


def find_codes(weight: torch.Tensor, coding: Coding,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes ``[n, k]`` (int16), scales and offsets ``[n, k / BLOCK]`` that expand to
    ``weight``'s very bits under ``coding``, or None (``k`` not whole blocks, another dtype,
    or some block not so coded)."""
    if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK
            or weight.device.type != "cpu"):
        return None
    rows, inputs = weight.shape
    if coding.is_bfloat16:
        return _as_bfloat16(weight.detach())
    if _code_rows(weight[:1].detach().reshape(1, -1, BLOCK), coding) is None:
        return None  # most weights are not coded: said by their first row, cheaply
    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for start in range(0, rows, ROWS_AT_ONCE):
        part = weight[start:start + ROWS_AT_ONCE].detach().reshape(-1, inputs // BLOCK, BLOCK)
        coded = _code_rows(part, coding)
        if coded is None:
            return None
        found.append(coded)
    codes, scales, offsets = (torch.cat(parts) for parts in zip(*found, strict=True))
    return codes.reshape(rows, inputs), scales, offsets


def _as_bfloat16(weight: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``weight``'s bfloat16s as codes (their 16 bits; no scales or offsets), or None where
    some number is not a bfloat16."""
    for start in range(0, weight.shape[0], ROWS_AT_ONCE):
        part = weight[start:start + ROWS_AT_ONCE]
        if not torch.equal(part.to(torch.bfloat16).to(torch.float32).view(torch.int32),
                           part.view(torch.int32)):
            return None
    none = torch.empty(0)
    return weight.to(torch.bfloat16).view(torch.int16), none, none


@dataclass(frozen=True, slots=True)
class CodedBlocks:
    """A weight ``[n, k]`` as coded panels: ``data`` ``[ceil(n / 16), k / 32, block_bytes]``
    bytes (``native/panel_products.c`` says the layout), columns past ``n`` zero."""

    data: torch.Tensor
    coding: Coding

    @classmethod
    def of(cls, weight: torch.Tensor) -> CodedBlocks | None:
        """``weight`` coded with the first coding of ``CODINGS`` that gives back its bits, or
        None where none does."""
        for coding in CODINGS:
            found = find_codes(weight, coding)
            if found is not None:
                return cls(data=_lay_out(*found, coding), coding=coding)
        return None

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The plain weight's rows ``ids`` (1-D), ``[len, k]`` float32, expanded: only their
        own columns' codes (an embedding lookup of a long prompt, without expanding whole
        panels)."""
        data = self.data[ids // PANEL]
        count, blocks, _ = data.shape
        picked, column = torch.arange(count), ids % PANEL
        if self.coding.is_bfloat16:
            halves = data.view(torch.bfloat16).reshape(count, blocks, BLOCK, PANEL)
            return halves[picked, :, :, column].to(torch.float32).reshape(count, -1)
        scale, offset, codes = self._fields(data, lambda x: x[picked, ..., column])
        return expand(codes, scale, offset).reshape(count, blocks * BLOCK)

    def panels(self) -> torch.Tensor:
        """Every panel's numbers, ``[n / 16, k, 16]`` float32, expanded."""
        data = self.data
        count, blocks, _ = data.shape
        if self.coding.is_bfloat16:
            halves = data.view(torch.bfloat16).reshape(count, blocks * BLOCK, PANEL)
            return halves.to(torch.float32)
        scale, offset, codes = self._fields(data, lambda x: x)
        # [count, blocks, 16, 32] so that a column's block expands as one row of ``expand``
        numbers = expand(codes.transpose(2, 3), scale, offset)
        return numbers.transpose(2, 3).reshape(count, blocks * BLOCK, PANEL)

    def _fields(self, data: torch.Tensor,
                columns: Callable[[torch.Tensor], torch.Tensor],
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scales and offsets ``[count, blocks, ...]`` and codes ``[count, blocks, 32,
        ...]`` of the coded blocks ``data`` (``[count, blocks, bytes]``, 4 or 8 bits), each
        field's last dimension (the panel's 16 columns) passed through ``columns`` first."""
        count, blocks, _ = data.shape
        scale = columns(data[..., :PANEL * 4].contiguous().view(torch.float32))
        offset = columns(data[..., PANEL * 4:PANEL * 8].contiguous().view(torch.float32))
        raw = data[..., PANEL * 8:]
        if self.coding.bits == 4:  # two inputs a byte: the first in the low nibble
            pairs = columns(raw.reshape(count, blocks, BLOCK // 2, PANEL))
            codes = torch.stack([pairs & 15, pairs >> 4], dim=3)
            return scale, offset, codes.reshape(count, blocks, BLOCK, *pairs.shape[3:])
        return scale, offset, columns(raw.reshape(count, blocks, BLOCK, PANEL).view(torch.int8))


def _lay_out(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
             coding: Coding) -> torch.Tensor:
    rows, inputs = codes.shape
    panels, blocks = -(-rows // PANEL), inputs // BLOCK
    padding = panels * PANEL - rows
    if padding:
        codes = torch.cat([codes, codes.new_zeros(padding, inputs)])
    # [panels, blocks, BLOCK, 16]: block b of panel p, input by input, its 16 columns' codes
    by_input = codes.reshape(panels, PANEL, blocks, BLOCK).permute(0, 2, 3, 1)
    if coding.is_bfloat16:
        return by_input.contiguous().view(torch.uint8).reshape(panels, blocks, -1)
    if padding:
        scale = torch.cat([scale, scale.new_zeros(padding, blocks)])
        offset = torch.cat([offset, offset.new_zeros(padding, blocks)])
    if coding.bits == 4:
        low, high = by_input[:, :, 0::2, :], by_input[:, :, 1::2, :]
        raw = (low | (high << 4)).to(torch.uint8)
    else:
        raw = by_input.to(torch.int8).view(torch.uint8)
    columns = (scale, offset)
    heads = [c.reshape(panels, PANEL, blocks).permute(0, 2, 1).contiguous()
             .view(torch.uint8) for c in columns]
    return torch.cat([*heads, raw.reshape(panels, blocks, -1)], dim=-1).contiguous()
