"""Projection weights kept in the layout their kernel reads, laid out once at start-up: oneDNN's
blocked layout, or the panels of kvgate's own kernel (``gateway.engine.linear.panel_products``).
Each is a ``WeightLayout`` of ``LAYOUTS``: how a plain weight is packed and read back plain.

Why oneDNN's: a plain (row-major) weight handed to oneDNN's inner product is reordered into the
blocked layout its kernel reads on every call. For a step of a few rows -- decoding, where the
weights are read once per step -- that reorder is most of the product's time: measured on this
project's 2-core AMD EPYC (AVX-512, float32, SmolLM2-135M's 210 projections, out of cache), a
step of 8 rows took 35.5 ms plain and 20.6 ms packed, of 2 rows 28.4 and 22.7 ms. Packing is
what inductor's weight freezing does for the same kernel.

Why exactness holds for oneDNN: packing changes where a weight's numbers lie, not the products'
arithmetic -- but whether oneDNN picks the same kernel for a packed weight is the library's and
the CPU's business, never assumed. ``packing_problem`` multiplies every weight shape, packed and
plain, at every row count the padding search samples; only where every row has the same bits are
the weights packed (so blocks computed either way are the same blocks, and keep their
namespace), and the start-up probe then checks the whole forward on the packed weights. The
panel kernel reads only panels, so for it packing is not a choice (its arithmetic is its own, in
its own namespace part).

Why in place: the point is speed without a second copy of the weights. Each packed module
replaces its ``nn.Linear`` (the plain tensor is released as the packed one is made, so memory
holds one copy at any time), and ``unpack_projections`` puts plain ones back (exactly: a
reorder moves numbers, it computes none) for a route that multiplies plain weights. transformers'
model built over the same modules (the serial route's, the cold references') reads a packed
module's plain weight through its state dict, as a copy made then.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gateway.engine.linear.panel_products import Panels

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


Packed = torch.Tensor | Panels
"""A weight as its kernel reads it: oneDNN's tensor, or panels."""


@dataclass(frozen=True, slots=True)
class WeightLayout:
    """How one kernel's weights are laid out: ``pack`` a plain ``[out, in]`` weight, read a
    packed one back ``plain`` (a copy; the numbers moved, none computed). ``looks_up_rows``:
    an embedding table can read its rows from it (a tied logits head packed with its table)."""

    name: str
    pack: Callable[[torch.Tensor], Packed]
    plain: Callable[[Packed], torch.Tensor]
    looks_up_rows: bool = False


def _onednn_plain(packed: Packed) -> torch.Tensor:
    assert isinstance(packed, torch.Tensor)
    return packed.to_dense()


def _panels_plain(packed: Packed) -> torch.Tensor:
    assert isinstance(packed, Panels)
    return packed.plain()


ONEDNN_LAYOUT = WeightLayout("onednn", pack, _onednn_plain)
PANEL_LAYOUT = WeightLayout("panels", Panels.of, _panels_plain, looks_up_rows=True)
LAYOUTS: Mapping[str, WeightLayout] = {"onednn": ONEDNN_LAYOUT, "panels": PANEL_LAYOUT}
"""The layouts by the name of the kernel that reads them."""


class PackedLinear(nn.Module):
    """A linear projection over a packed weight: what ``RowProducts.project`` reads (``weight``,
    ``bias``) and, called as a module, what transformers' forward calls.

    ``weight`` is the layout's (oneDNN's tensor, or ``Panels``; its ``shape`` is the plain
    ``[out, in]``); only its kernel reads it. ``original`` is the module it replaced, its weight
    removed, kept so that unpacking restores the very module (its class, hooks and
    attributes)."""

    def __init__(self, original: nn.Module, packed: Packed,
                 layout: WeightLayout = ONEDNN_LAYOUT) -> None:
        super().__init__()
        self.original = [original]  # a list: not registered as a submodule (no second walk)
        self.weight = packed
        self.layout = layout
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
        return self.layout.plain(self.weight)

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


def pack_projections(projections: Sequence[Projection],
                     layout: WeightLayout = ONEDNN_LAYOUT) -> int:
    """Pack every plain projection of ``projections`` in place for ``layout``, one at a time
    (already packed ones are left); returns how many were packed."""
    count = released = 0
    for where in projections:
        module = where.module
        weight = _plain_weight(module)
        if weight is None:
            continue
        packed = layout.pack(weight)
        del weight
        _drop_weight(module)
        setattr(where.parent, where.name, PackedLinear(module, packed, layout))
        count += 1
        released += packed.shape[0] * packed.shape[1] * packed.dtype.itemsize
        if released >= RELEASE_EVERY_BYTES:
            release_freed_memory()
            released = 0
    release_freed_memory()
    return count


def _drop_weight(module: nn.Module) -> None:
    if "weight" in module._parameters:
        del module._parameters["weight"]
    else:
        delattr(module, "weight")


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
    if isinstance(head, nn.Module) and not is_tied(model, head):
        yield Projection(model, "lm_head")


def is_tied(model: Any, head: nn.Module) -> bool:
    """Whether the logits ``head`` multiplies by the input embeddings' very table."""
    embeddings_module = model.model.embed_tokens
    if isinstance(head, PackedLinear) or isinstance(embeddings_module, PackedEmbedding):
        return getattr(embeddings_module, "weight", None) is head.weight
    weight = getattr(head, "weight", None)
    embeddings = model.model.embed_tokens.weight
    return weight is embeddings or (isinstance(weight, torch.Tensor)
                                    and weight.data_ptr() == embeddings.data_ptr())


class PackedEmbedding(nn.Module):
    """An embedding table read from the packed weight of the logits head tied to it (a layout
    that ``looks_up_rows``): one copy of the table serves both. ``original`` is the embedding
    module it replaced (one that only looks rows up: ``embedding_problem``), kept for
    unpacking."""

    def __init__(self, original: nn.Module, packed: Panels) -> None:
        super().__init__()
        self.original = [original]
        self.weight = packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight.row(ids)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight.plain()


def embedding_problem(model: Any, layout: WeightLayout) -> str | None:
    """Why ``model``'s tied logits head cannot be packed with its embedding table for
    ``layout``, or None (also None where the head is not tied: it is packed as a projection)."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module) or not is_tied(model, head):
        return None
    if not layout.looks_up_rows:
        return f"{layout.name}'s layout cannot serve the embedding lookups of a tied head"
    table = model.model.embed_tokens
    if isinstance(table, PackedEmbedding):
        return None
    weight = table.weight
    ids = torch.tensor(sorted({0, 1, int(weight.shape[0]) // 2, int(weight.shape[0]) - 1}),
                       device=weight.device)
    with torch.inference_mode():
        looked_up = table(ids)
    if not torch.equal(looked_up, weight[ids]):
        return (f"its tied head's embeddings ({type(table).__name__}) do more than look up "
                "rows (a scale)")
    return None


def pack_tied_head(model: Any, layout: WeightLayout) -> bool:
    """Pack a tied logits head and its embedding table into one ``layout`` copy (in place;
    ``embedding_problem`` said it can); returns whether anything was packed."""
    head = getattr(model, "lm_head", None)
    body = model.model
    if (not isinstance(head, nn.Module) or isinstance(head, PackedLinear)
            or not is_tied(model, head)):
        return False
    packed = layout.pack(body.embed_tokens.weight)
    assert isinstance(packed, Panels)
    table = body.embed_tokens
    _drop_weight(table)
    _drop_weight(head)
    body.embed_tokens = PackedEmbedding(table, packed)
    model.lm_head = PackedLinear(head, packed, layout)
    release_freed_memory()
    return True


def unpack_tied_head(model: Any) -> bool:
    """Put a tied head packed with its table back as the two modules they replaced, over one
    plain table again; returns whether anything was unpacked."""
    body = model.model
    table = body.embed_tokens
    if not isinstance(table, PackedEmbedding):
        return False
    head = model.lm_head
    plain = nn.Parameter(table.weight.plain(), requires_grad=False)
    original_table, original_head = table.original[0], head.original[0]
    original_table.weight = plain
    original_head.weight = plain
    body.embed_tokens = original_table
    model.lm_head = original_head
    return True
