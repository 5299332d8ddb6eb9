"""How a block's tensors become the payload bytes of a blob, and back: the codec's seam.

``tiers.codec.BlockCodec`` owns everything around the payload -- header, identity checks, the
MAC, compression -- and delegates the tensor bytes themselves to one ``PayloadFormat``:

- ``ExactPayload``: the tensors' own bytes, restored bit for bit (every tier by default).
- ``QuantizedPayload``: int8 or fp8 values and one float32 scale per (layer, K or V, KV head,
  token) (``tiers.kv_quant``), dequantized into the model's K/V dtype on the way back. Its
  blocks come back marked (``KVBlock.quantization``), and its header carries another format
  code than any exact dtype's, so neither codec reads the other's blobs.

Byte layout of a quantized payload (little-endian, C-contiguous)::

    scales  float32 [num_layers, 2 (K, V), kv_heads, block_tokens]
    values  int8 or float8_e4m3fn [num_layers, 2, kv_heads, block_tokens, head_dim]

(scales first, so that both views start aligned in the one buffer a decode allocates).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from gateway.core.quantization import Quantization
from tiers.base import CodecError
from tiers.block_format import DTYPE_TO_CODE, QUANTIZATION_TO_CODE
from tiers.kv_quant import (
    SCALE_BYTES,
    SCALE_DTYPE,
    dequantize,
    element_dtype,
    quantize,
    quantized_bytes_per_token,
)
from tiers.payload import KVBlock, KVLayout


class PayloadFormat(Protocol):
    """Tensor bytes of one block under one layout and block size.

    ``raw_len`` is exact: ``pieces`` always yields that many bytes and ``unpack`` is only given
    buffers of that length (the codec checks both against the authenticated header).
    """

    @property
    def format_code(self) -> int:
        """The header's dtype/format byte (``tiers.block_format``)."""
        ...

    @property
    def raw_len(self) -> int:
        """Payload bytes of one block, before compression."""
        ...

    @property
    def quantization(self) -> Quantization | None:
        """None: exact; else the lossy format (the blocks it returns say so too)."""
        ...

    def pieces(self, block: KVBlock) -> list[memoryview]:
        """The payload of ``block`` as byte views, in order (the block was checked against
        the layout). Raises CodecError when the block may not be stored in this format."""
        ...

    def unpack(self, flat: torch.Tensor, *, into: KVBlock | None = None) -> KVBlock:
        """The block held by ``flat`` (uint8, ``raw_len`` bytes, owned by the caller).

        ``into``: a block of the layout's shape and dtype, packed (a page of the pool, on the
        CPU or a GPU), that the K/V are written into and that is returned, marked with this
        format's quantization. Without it, views of ``flat`` or a buffer of the block's own.
        """
        ...


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat byte view of the tensor, copied only if it is not on the CPU or not contiguous
    (the view keeps its tensor alive)."""
    cpu = tensor.detach().to("cpu").contiguous()
    return cpu.view(torch.uint8).numpy().reshape(-1).data


class ExactPayload:
    """The tensors' own bytes: for each layer, K then V, each [kv_heads, block_tokens,
    head_dim]."""

    def __init__(self, layout: KVLayout, block_tokens: int) -> None:
        self._layout = layout
        self._block_tokens = block_tokens
        self._code = DTYPE_TO_CODE[layout.dtype]

    @property
    def format_code(self) -> int:
        return self._code

    @property
    def raw_len(self) -> int:
        return self._layout.block_nbytes(self._block_tokens)

    @property
    def quantization(self) -> Quantization | None:
        return None

    def pieces(self, block: KVBlock) -> list[memoryview]:
        if block.quantization is not None:
            # A dequantized block is not what the model computed: storing it here would let an
            # exact request read it (docs/design.md, "Lossy tiers").
            raise CodecError("shape", f"a block dequantized from {block.quantization} cannot "
                                      "be stored in an exact tier")
        return [_byte_view(t) for kv in zip(block.keys, block.values, strict=True) for t in kv]

    def unpack(self, flat: torch.Tensor, *, into: KVBlock | None = None) -> KVBlock:
        layout = self._layout
        per_layer = flat.view(layout.dtype).view(
            layout.num_layers, 2, layout.kv_heads, self._block_tokens, layout.head_dim
        )
        if into is None:
            return KVBlock.of_packed(per_layer)
        packed_of(into).copy_(per_layer)
        return into


class QuantizedPayload:
    """Scales, then quantized values (module docstring); decoded into ``layout.dtype``."""

    def __init__(self, layout: KVLayout, block_tokens: int, quantization: Quantization) -> None:
        self._layout = layout
        self._block_tokens = block_tokens
        self._quantization: Quantization = quantization
        self._element = element_dtype(quantization)
        self._rows = (layout.num_layers, 2, layout.kv_heads, block_tokens)
        self._scales_len = layout.num_layers * 2 * layout.kv_heads * block_tokens * SCALE_BYTES

    @property
    def format_code(self) -> int:
        return QUANTIZATION_TO_CODE[self._quantization]

    @property
    def raw_len(self) -> int:
        layout = self._layout
        return self._block_tokens * quantized_bytes_per_token(
            layout.num_layers, layout.kv_heads, layout.head_dim)

    @property
    def quantization(self) -> Quantization | None:
        return self._quantization

    def pieces(self, block: KVBlock) -> list[memoryview]:
        if block.quantization not in (None, self._quantization):
            raise CodecError("shape", f"a block dequantized from {block.quantization} cannot "
                                      f"be stored as {self._quantization}")
        # Quantized where the tensors live (a GPU sends a quarter of the bytes to the CPU).
        stacked = torch.stack([torch.stack(kv) for kv in zip(block.keys, block.values,
                                                             strict=True)])
        q, scales = quantize(stacked, self._quantization)
        return [_byte_view(scales.to(SCALE_DTYPE)), _byte_view(q.view(torch.uint8))]

    def round_trip(self, block: KVBlock) -> KVBlock:
        """What ``unpack`` gives for ``pieces(block)``, without the bytes: the copy a lossy tier
        serves of a block it has not written yet."""
        if block.quantization not in (None, self._quantization):
            raise CodecError("shape", f"a block dequantized from {block.quantization} cannot "
                                      f"be stored as {self._quantization}")
        stacked = torch.stack([torch.stack(kv) for kv in zip(block.keys, block.values,
                                                             strict=True)])
        q, scales = quantize(stacked, self._quantization)
        return KVBlock.of_packed(dequantize(q.cpu(), scales.cpu(), self._layout.dtype),
                                 self._quantization)

    def unpack(self, flat: torch.Tensor, *, into: KVBlock | None = None) -> KVBlock:
        layout = self._layout
        scales = flat[: self._scales_len].view(SCALE_DTYPE).view(self._rows)
        q = flat[self._scales_len :].view(self._element).view(*self._rows, layout.head_dim)
        if into is None:
            return KVBlock.of_packed(dequantize(q, scales, layout.dtype), self._quantization)
        dequantize(q, scales, layout.dtype, out=packed_of(into))
        return dataclasses.replace(into, quantization=self._quantization)


def payload_format(layout: KVLayout, block_tokens: int,
                   quantization: Quantization | None) -> PayloadFormat:
    """The format of a tier that stores ``quantization`` (None: exact)."""
    if quantization is None:
        return ExactPayload(layout, block_tokens)
    return QuantizedPayload(layout, block_tokens, quantization)


def packed_of(block: KVBlock) -> torch.Tensor:
    """``block.packed``, which a block to decode into must have."""
    if block.packed is None:
        raise ValueError("a block to decode into must be packed (a page of the pool)")
    return block.packed
