"""A lossy host tier: each block as int8 or fp8 values and float32 scales, in one slot.

Why: a host tier of float32 K/V holds a quarter of the blocks it could hold quantized
(``tiers.kv_quant``: 0.266x at ``head_dim = 64``). The cache core gives a lossy tier blocks of
lossy namespaces only (docs/design.md, "Lossy tiers"); this store only keeps bytes.

A slot holds exactly the quantized payload of the disk and Redis codec
(``tiers.payload_format.QuantizedPayload``: scales, then values), so that a block read from
here is bit for bit the block a lossy blob of it decodes to, whichever lossy tier serves it.
The slot is one contiguous buffer: a block is quantized where it lives (on the GPU, a quarter
of the bytes then cross to the host), packed there into one buffer and copied into its slot in
one copy; ``get`` copies the slot to ``serve_device`` in one copy and dequantizes it there.

Pinned slots, asynchronous copies and the fences that keep a slot from reuse while a copy
still reads it are ``tiers.memory.HostStore``'s, line for line (see that module's docstring).
They cannot run without CUDA; the tests marked ``gpu`` cover them on a GPU, as HostStore's do.
"""

from __future__ import annotations

import dataclasses

import torch

from gateway.core.quantization import QUANTIZATIONS, Quantization
from tiers.base import BlockMeta, CodecError, TierConfigError
from tiers.copy_fence import FenceFactory, record_fence
from tiers.kv_quant import (
    SCALE_BYTES,
    SCALE_DTYPE,
    dequantize,
    element_dtype,
    quantize,
    quantized_bytes_per_token,
    supported,
)
from tiers.memory import SlabPool, SlabStore, default_device, take_slot
from tiers.payload import KVBlock, KVLayout, PayloadError
from tiers.payload_format import packed_of


class QuantizedHostStore(SlabStore[torch.Tensor]):
    """Block payloads quantized in CPU memory, in slots of a slab pool.

    Args:
        layout: the model's KV layout (``get`` returns blocks in ``layout.dtype``).
        block_tokens: tokens per block.
        budget_bytes: the most slot bytes held (a slot is one block's quantized payload).
        quantization: the lossy format kept ("int8", "fp8").
        pin: use pinned memory; default: whether CUDA is available.
        serve_device: where ``get`` delivers blocks (the model's device by default).
        fences: records a fence after a queued copy (``tiers.copy_fence``).

    Raises:
        TierConfigError: an unknown quantization, or one torch cannot run on the CPU or on
            ``serve_device``.
    """

    def __init__(
        self,
        *,
        layout: KVLayout,
        block_tokens: int,
        budget_bytes: int,
        quantization: Quantization,
        pin: bool | None = None,
        serve_device: torch.device | str | None = None,
        name: str,
        fences: FenceFactory = record_fence,
    ) -> None:
        super().__init__(name=name)
        self.serve_device = (
            torch.device(serve_device) if serve_device is not None else default_device()
        )
        if quantization not in QUANTIZATIONS:
            raise TierConfigError(f"unknown quantization {quantization!r}; expected one of "
                                  f"{', '.join(QUANTIZATIONS)}")
        for device_type in {"cpu", self.serve_device.type}:
            if not supported(quantization, device_type):
                raise TierConfigError(f"torch {torch.__version__} cannot quantize K/V to "
                                      f"{quantization} on {device_type}: use int8")
        self.layout = layout
        self.block_tokens = block_tokens
        self.quantization: Quantization = quantization
        self._element = element_dtype(quantization)
        self._rows = (layout.num_layers, 2, layout.kv_heads, block_tokens)
        self._scales_len = layout.num_layers * 2 * layout.kv_heads * block_tokens * SCALE_BYTES
        # Slots are only ever copied as bytes, never viewed as scales in place (``get`` views
        # its own copy), so a slot need not start aligned to a scale within its slab.
        self._slot_bytes = block_tokens * quantized_bytes_per_token(
            layout.num_layers, layout.kv_heads, layout.head_dim)
        self.is_pinned = torch.cuda.is_available() if pin is None else pin
        self._pool = SlabPool(
            slot_bytes=self._slot_bytes,
            max_slots=budget_bytes // self._slot_bytes,
            pin=self.is_pinned,
        )
        self._fences = fences

    def _slot_of(self, entry: torch.Tensor) -> torch.Tensor:
        return entry  # the slot itself

    def _notes(self) -> dict[str, int | float | str]:
        return {**SlabStore._notes(self), "quantization": self.quantization}

    @property
    def slot_bytes(self) -> int:
        """Bytes one block takes (its quantized payload; what ``num_bytes`` counts)."""
        return self._slot_bytes

    def _check(self, block: KVBlock) -> None:
        """Refuse what this tier may not hold, as the lossy codec does (CodecError "shape")."""
        if block.quantization not in (None, self.quantization):
            raise CodecError("shape", f"a block dequantized from {block.quantization} cannot "
                                      f"be stored as {self.quantization}")
        try:
            block.check(self.layout, self.block_tokens)
        except PayloadError as exc:
            raise CodecError("shape", f"cannot store block: {exc}") from exc

    def _packed_payload(self, block: KVBlock) -> torch.Tensor:
        """Scales then values as one uint8 buffer on the block's device (the codec's payload
        layout). Raises CodecError "shape" for K/V that is not finite."""
        rows = block.packed
        if rows is None:
            rows = torch.stack([torch.stack(kv) for kv in zip(block.keys, block.values,
                                                              strict=True)])
        q, scales = quantize(rows, self.quantization)
        return torch.cat((scales.to(SCALE_DTYPE).reshape(-1).view(torch.uint8),
                          q.reshape(-1).view(torch.uint8)))

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        """Quantize and keep ``block``; a put beyond the budget is dropped and counted.

        Raises:
            CodecError: reason "shape": the block was dequantized from another format, does
                not match the layout, or holds NaN or infinity (nothing is stored).
        """
        self._check(block)
        with self._lock:
            if meta.key in self._entries:
                self._stats.puts += 1
                return
            slot = take_slot(self._pool, self._stats)
            if slot is None:
                return
        # Quantized and copied outside the lock; readable only once the copy is complete.
        try:
            payload = self._packed_payload(block)
        except BaseException:
            with self._lock:
                self._pool.give_back(slot)
            raise
        source = payload.device
        non_blocking = self.is_pinned and source.type == "cuda"
        slot.copy_(payload, non_blocking=non_blocking)  # one copy
        done = self._fences(source) if self.is_pinned else None
        if done is not None:
            done.wait()  # this copy only: the source device's stream, up to here
        with self._lock:
            if meta.key in self._entries:  # a concurrent put of the same block won
                self._pool.give_back(slot)
            else:
                self._add(meta.key, slot)
            self._stats.puts += 1

    def get(self, meta: BlockMeta, *, into: KVBlock | None = None) -> KVBlock | None:
        """The block dequantized to ``layout.dtype`` on ``serve_device``, marked lossy; with
        ``into`` (a page of the pool it is meant for), dequantized into it: no buffer of its
        own."""
        # Copied under the lock, with a fence recorded after it (as HostStore.get): a delete
        # that follows hands the slot back only for reuse once this copy has read it.
        with self._lock:
            slot = self._count_lookup(self._entries.get(meta.key))
            if slot is None:
                return None
            non_blocking = self.is_pinned and self.serve_device.type == "cuda"
            flat = slot.to(self.serve_device, non_blocking=non_blocking, copy=True)
            if self.is_pinned:
                fence = self._fences(self.serve_device)
                if fence is not None:
                    reads = [f for f in self._reads.get(meta.key, ()) if not f.is_done()]
                    self._reads[meta.key] = [*reads, fence]
        # Dequantized on the serving device, from the copy (stream-ordered after it).
        scales = flat[: self._scales_len].view(SCALE_DTYPE).view(self._rows)
        q = flat[self._scales_len :].view(self._element).view(*self._rows, self.layout.head_dim)
        if into is not None:
            dequantize(q, scales, self.layout.dtype, out=packed_of(into))
            return dataclasses.replace(into, quantization=self.quantization)
        return KVBlock.of_packed(dequantize(q, scales, self.layout.dtype), self.quantization)
