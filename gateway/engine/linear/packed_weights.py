"""Projection weights kept in oneDNN's own blocked layout, packed once at start-up.

Why: a plain (row-major) weight handed to oneDNN's inner product is reordered into the blocked
layout its kernel reads on every call. For a step of a few rows -- decoding, where the weights
are read once per step -- that reorder is most of the product's time: measured on this
project's 2-core AMD EPYC (AVX-512, float32, SmolLM2-135M's 210 projections, out of cache), a
step of 8 rows took 35.5 ms plain and 20.6 ms packed, of 2 rows 28.4 and 22.7 ms. Packing is
what inductor's weight freezing does for the same kernel.

Why exactness holds: packing changes where a weight's numbers lie, not the products' arithmetic
-- but whether oneDNN picks the same kernel for a packed weight is the library's and the CPU's
business, never assumed. ``packing_problem`` multiplies every weight shape, packed and plain, at
every row count the padding search samples; only where every row has the same bits are the
weights packed (so blocks computed either way are the same blocks, and keep their namespace),
and the start-up probe then checks the whole forward on the packed weights.

Why in place: the point is speed without a second copy of the weights. Each packed module
replaces its ``nn.Linear`` (the plain tensor is released as the packed one is made, so memory
holds one copy at any time), and ``unpack_projections`` puts plain ones back (exactly: a
reorder moves numbers, it computes none) for a route that multiplies plain weights. transformers'
model built over the same modules (the serial route's, the cold references') reads a packed
module's plain weight through its state dict, as a copy made then.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

RELEASE_EVERY_BYTES = 32 << 20
"""While packing, the heap's free pages go back to the system after each this many bytes
packed: the most memory packing holds beyond one copy of the weights."""

PACKED_FOR_ROWS = 8
"""The row count oneDNN is told to pack for: a decode step of a few users (measured above, the
layouts packed for 2 to 64 rows ran within 5 % of each other at 2 to 512 rows; for 1 row, 20 to
60 % slower)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` in oneDNN's blocked layout for its inner product."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                   PACKED_FOR_ROWS)
    return packed


class PackedLinear(nn.Module):
    """A linear projection over a packed weight: what ``RowProducts.project`` reads (``weight``,
    ``bias``) and, called as a module, what transformers' forward calls.

    ``weight`` is oneDNN's tensor (its ``shape`` is the plain ``[out, in]``); only oneDNN's
    inner product reads it. ``original`` is the module it replaced, its weight removed, kept so
    that unpacking restores the very module (its class, hooks and attributes)."""

    def __init__(self, original: nn.Module, packed: torch.Tensor) -> None:
        super().__init__()
        self.original = [original]  # a list: not registered as a submodule (no second walk)
        self.weight = packed
        bias = getattr(original, "bias", None)
        self.bias = bias.detach() if bias is not None else None
        self.in_features, self.out_features = int(packed.shape[1]), int(packed.shape[0])

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """What the module it replaced computes (``F.linear`` of the plain weight, copied for
        the call): transformers' forward (the serial route, the cold references) keeps its own
        numerics over a packed model."""
        return F.linear(rows, self.plain_weight(), self.bias)

    def plain_weight(self) -> torch.Tensor:
        """The weight in its plain layout (a copy)."""
        return self.weight.to_dense()

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.plain_weight()
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias


@dataclass(frozen=True, slots=True)
class Projection:
    """Where a projection module hangs: ``getattr(parent, name)``."""

    parent: nn.Module
    name: str

    @property
    def module(self) -> nn.Module:
        module: nn.Module = getattr(self.parent, self.name)
        return module


def _plain_weight(module: nn.Module) -> torch.Tensor | None:
    """A module's plain 2-D weight where it is a projection that may be packed, else None."""
    weight = getattr(module, "weight", None)
    if (isinstance(module, PackedLinear) or not isinstance(weight, torch.Tensor)
            or weight.dim() != 2 or weight.is_mkldnn or weight.device.type != "cpu"
            or not weight.dtype.is_floating_point):
        return None
    return weight


def pack_projections(projections: Sequence[Projection]) -> int:
    """Pack every plain projection of ``projections`` in place, one at a time (already packed
    ones are left); returns how many were packed."""
    count = released = 0
    for where in projections:
        module = where.module
        weight = _plain_weight(module)
        if weight is None:
            continue
        packed = pack(weight)
        del weight
        if "weight" in module._parameters:
            del module._parameters["weight"]
        else:
            delattr(module, "weight")
        setattr(where.parent, where.name, PackedLinear(module, packed))
        count += 1
        released += packed.shape[0] * packed.shape[1] * packed.dtype.itemsize
        if released >= RELEASE_EVERY_BYTES:
            release_freed_memory()
            released = 0
    release_freed_memory()
    return count


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Why: a plain weight freed as its packed copy is made goes back to the heap, not
    to the system, and the packed copies that follow do not always fit the holes it leaves --
    measured, packing SmolLM2-135M's projections without it left 142 MB more resident than
    before packing, with it 23 MB less."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return
    trim(0)


def unpack_projections(projections: Sequence[Projection]) -> int:
    """Put every packed module of ``projections`` back as the module it replaced, its weight
    plain again; returns how many were unpacked."""
    count = 0
    for where in projections:
        module = where.module
        if not isinstance(module, PackedLinear):
            continue
        original = module.original[0]
        original.weight = nn.Parameter(module.plain_weight(), requires_grad=False)
        setattr(where.parent, where.name, original)
        count += 1
    return count


def plain_weights(projections: Sequence[Projection]) -> list[torch.Tensor]:
    """The plain weights of ``projections`` that may be packed (packed ones left out)."""
    found = (_plain_weight(where.module) for where in projections)
    return [weight for weight in found if weight is not None]


def packed_count(projections: Sequence[Projection]) -> int:
    """How many of ``projections`` are packed now."""
    return sum(isinstance(where.module, PackedLinear) for where in projections)


def packing_problem(weights: Sequence[torch.Tensor], counts: Sequence[int],
                    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    ) -> str | None:
    """Why packing would change a row's bits (or cannot be done) for these weights, or None.

    Every weight is multiplied plain and packed by ``product`` at each row count of ``counts``
    (random rows, the weight's dtype); any difference in any row is a problem.
    """
    generator = torch.Generator().manual_seed(0)
    for weight in weights:
        try:
            packed = pack(weight)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            return f"oneDNN cannot pack a {tuple(weight.shape)} weight here: {exc}"
        rows = torch.randn(max(counts), weight.shape[1], generator=generator).to(weight.dtype)
        for count in counts:
            plain = product(rows[:count], weight)
            if not torch.equal(plain, product(rows[:count], packed)):
                return (f"a {tuple(weight.shape)} weight's rows change when packed "
                        f"({count} rows)")
    return None


def walk_projections(model: Any, attention_names: Sequence[str],
                     mlp_names: Sequence[str]) -> Iterator[Projection]:
    """Each layer's attention and MLP projections named, and the logits head where it is not
    the input embeddings' table (a tied head stays plain: the embeddings read its rows)."""
    for layer in model.model.layers:
        for parent, names in ((getattr(layer, "self_attn", None), attention_names),
                              (getattr(layer, "mlp", None), mlp_names)):
            if parent is None:
                continue
            for name in names:
                if isinstance(getattr(parent, name, None), nn.Module):
                    yield Projection(parent, name)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module) and not _is_tied(model, head):
        yield Projection(model, "lm_head")


def _is_tied(model: Any, head: nn.Module) -> bool:
    if isinstance(head, PackedLinear):
        return False  # packed only where it was not tied
    weight = getattr(head, "weight", None)
    embeddings = model.model.embed_tokens.weight
    return weight is embeddings or (isinstance(weight, torch.Tensor)
                                    and weight.data_ptr() == embeddings.data_ptr())
