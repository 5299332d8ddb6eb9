"""Projections that multiply the same rows, laid out as one panel weight and multiplied in one
call of the panel kernel: a layer's q, k and v, and its MLP's gate and up.

Why: every product is one parallel region of the kernel, and ``kvgate serve`` lets its
OpenMP threads sleep between regions (``gateway.cli.openmp_wait``), so each region wakes a
thread first: measured on this project's 2-core AMD EPYC, a one-row product of a 192 x 576 weight
took 78 us with threads asleep against 9 us with them spinning. Joined, a Llama layer's seven
products are four: 90 of a SmolLM2 decode step's 211 products and their wake-ups go.

Why exact: the panel kernel computes each output number alone, one fused multiply-add per input
in order, then its bias (``native/panel_products.c``), so which columns share a call changes no
number. The members keep their own weights as views of the joined panels (one copy in memory),
so transformers' model over the same modules and an unpacked route still read them one by one.
The joined output is split into views, not copies: each member's width is a whole number of
panels (16 columns, a multiple of every CPU's float vector), so an element-wise op reads a
member's rows with the same vector and tail split as it would read the member's own output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.linear.packed_weights import PANEL_LAYOUT, PackedLinear, release_freed_memory
from gateway.engine.linear.panel_products import PANEL, Panels

JOINED_QKV = "joined_qkv"
"""The attribute of a layer's attention holding its joined q, k and v (absent where not)."""
JOINED_GATE_UP = "joined_gate_up"
"""The attribute of a layer's MLP holding its joined gate and up (absent where not)."""

_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj"), JOINED_QKV),
           ("mlp", ("gate_proj", "up_proj"), JOINED_GATE_UP))


@dataclass(frozen=True, slots=True)
class JoinedProjection:
    """Several projections of the same rows as one: what ``RowProducts.project`` reads
    (``weight``, ``bias``), and each member's output width, in order."""

    weight: Panels
    bias: torch.Tensor | None
    widths: tuple[int, ...]

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The members' outputs (views) of the joined output ``out`` ``[rows, sum(widths)]``."""
        return tuple(torch.split(out, list(self.widths), dim=-1))


def joined(parent: Any, attribute: str) -> JoinedProjection | None:
    """``parent``'s joined projection ``attribute``, or None where its members are apart."""
    found = getattr(parent, attribute, None)
    return found if isinstance(found, JoinedProjection) else None


def join_panels(model: Any) -> int:
    """Join each layer's q/k/v and gate/up where all are laid out in panels (module docstring);
    returns how many groups were joined. Groups joined already are left."""
    count = 0
    for layer in model.model.layers:
        for parent_name, names, attribute in _GROUPS:
            parent = getattr(layer, parent_name, None)
            if parent is None or joined(parent, attribute) is not None:
                continue
            members = [getattr(parent, name, None) for name in names]
            if _joinable(members):
                setattr(parent, attribute, _join(members))  # type: ignore[arg-type]
                count += 1
    if count:
        release_freed_memory()
    return count


def unjoin_panels(model: Any) -> None:
    """Forget every joined group: the forward multiplies the members one by one again (their
    weights stay views of the joined panels until they are unpacked)."""
    for layer in model.model.layers:
        for parent_name, _, attribute in _GROUPS:
            parent = getattr(layer, parent_name, None)
            if parent is not None and attribute in vars(parent):
                delattr(parent, attribute)


def _joinable(members: Sequence[Any]) -> bool:
    if not all(isinstance(m, PackedLinear) and m.layout is PANEL_LAYOUT
               and isinstance(m.weight, Panels) for m in members):
        return False
    first = members[0].weight
    return (all(m.weight.shape[1] == first.shape[1] and m.weight.dtype == first.dtype
                and m.weight.device == first.device and m.weight.out_features % PANEL == 0
                and m.weight.coding == first.coding
                for m in members)
            and len({m.bias is None for m in members}) == 1)


def _join(members: Sequence[PackedLinear]) -> JoinedProjection:
    """The members' panels copied into one tensor, each member's weight made a view of it (its
    own panels freed)."""
    panels = [m.weight for m in members if isinstance(m.weight, Panels)]
    assert len(panels) == len(members)
    data = torch.cat([p.data for p in panels])
    start = 0
    for member in members:
        weight = member.weight
        assert isinstance(weight, Panels)
        size = int(weight.data.shape[0])
        member.weight = Panels(data=data[start:start + size], out_features=weight.out_features,
                               coding=weight.coding)
        start += size
    biases = [m.bias for m in members]
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    widths = tuple(m.out_features for m in members)
    return JoinedProjection(weight=Panels(data=data, out_features=sum(widths),
                                          coding=panels[0].coding),
                            bias=bias, widths=widths)
