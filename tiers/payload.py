"""One block's KV payload and the model layout it must match.

A block payload is the K and V tensors of every attention layer for ``block_tokens`` tokens,
each shaped ``[kv_heads, block_tokens, head_dim]``. Payloads held by a tier are shared by every
request that reads the block, so they are treated as read-only: a request copies them into its
own buffers (``gateway.engine.kv.sequence``) and never writes through them.

Shapes and sizes are always checked against a ``KVLayout`` taken from the model's config, never
trusted from stored headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gateway.core.quantization import Quantization


class PayloadError(ValueError):
    """A payload does not match the layout it is declared for."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KVLayout:
    """The shape of a model's KV cache: what every stored block is checked against."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token adds across all layers."""
        itemsize = self.dtype.itemsize
        return 2 * self.num_layers * self.kv_heads * self.head_dim * itemsize

    def block_nbytes(self, block_tokens: int) -> int:
        return self.bytes_per_token * block_tokens


@dataclass(frozen=True, slots=True)
class KVBlock:
    """K and V of every layer for one block (shared, read-only by convention).

    ``quantization`` is None for K/V as the model computed them; a block dequantized from a
    lossy tier names the format it came from, so that no exact tier stores it (the exact
    payload format refuses it: docs/design.md, "Lossy tiers").

    ``packed``, where a tier has it: one ``[layers, 2, kv_heads, tokens, head_dim]`` tensor of
    which every K (``packed[i, 0]``) and V (``packed[i, 1]``) is a view, so that a copy of the
    whole block is one copy (a GPU pays per copy launched, not per byte, at these sizes).
    """

    keys: Sequence[torch.Tensor]
    values: Sequence[torch.Tensor]
    quantization: Quantization | None = None
    packed: torch.Tensor | None = field(default=None, compare=False, repr=False)
    _nbytes: int = field(default=0, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Asked for several times per block per request (queues, budgets, load estimates): a
        # sum over 2 x layers tensors each time was a measurable part of a warm start.
        # A packed block's K/V are views tiling ``packed`` (``of_packed``): its size is theirs.
        nbytes = (self.packed.numel() * self.packed.element_size() if self.packed is not None
                  else sum(t.numel() * t.element_size() for t in (*self.keys, *self.values)))
        object.__setattr__(self, "_nbytes", nbytes)

    @classmethod
    def of_packed(cls, packed: torch.Tensor,
                  quantization: Quantization | None = None) -> KVBlock:
        """The block whose K/V are the layers of ``packed`` (``[layers, 2, ...]``), views."""
        layers = packed.unbind(0)
        return cls(keys=tuple(layer[0] for layer in layers),
                   values=tuple(layer[1] for layer in layers), quantization=quantization,
                   packed=packed)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        if self.packed is not None:  # [layers, 2, kv_heads, tokens, head_dim]
            return int(self.packed.shape[3])
        return int(self.keys[0].shape[1])

    @property
    def any_tensor(self) -> torch.Tensor:
        """One tensor of the block's memory (its device, its storage): ``packed`` where it has
        it, so that a page's lazily made layer views stay unmade."""
        return self.packed if self.packed is not None else self.keys[0]

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def check(self, layout: KVLayout, block_tokens: int) -> None:
        """Raise PayloadError unless every tensor has the layout's shape and dtype."""
        if len(self.keys) != layout.num_layers or len(self.values) != layout.num_layers:
            raise PayloadError(
                f"payload has {len(self.keys)}/{len(self.values)} K/V layers, "
                f"the model has {layout.num_layers}"
            )
        want = (layout.kv_heads, block_tokens, layout.head_dim)
        for i, tensor in enumerate((*self.keys, *self.values)):
            if tuple(tensor.shape) != want or tensor.dtype != layout.dtype:
                raise PayloadError(
                    f"tensor {i} is {tuple(tensor.shape)} {tensor.dtype}, "
                    f"expected {want} {layout.dtype}"
                )
