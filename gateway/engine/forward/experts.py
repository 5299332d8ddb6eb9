"""A sparse mixture of experts in the batched forward, each token's numbers its own.

Why not transformers' experts module: it gathers each expert's tokens from the whole step into
one product, so a token's bits would depend on how many others chose the same expert. Here every
product is the row products' own (``gateway.engine.linear.row_products``): an expert's rows from
the shared part of the step go into one product padded to a row count that keeps each row's
bits, the rows computed alone (decode rows, where they do not share) stay alone; the router's
softmax and top-k are row-wise; and a token's expert outputs are added in expert order, as
transformers adds them. So a token's output depends on that token alone, whatever else is in
the step (tests/gateway/engine/families/: a token alone equals it in a batch of others).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward.features import ExpertRouting
from gateway.engine.forward.recurrent.lanes import by_row
from gateway.engine.linear.row_products import RowProducts


@dataclass(frozen=True, slots=True)
class ExpertProjection:
    """One expert's slice of a fused expert tensor, as the row products read a projection
    (``weight`` ``[out, in]``, a view where the checkpoint stores it ``[in, out]``)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


ExpertRun = Callable[[int, torch.Tensor, int], torch.Tensor]
"""``run(expert, inputs, num_shared)``: one expert's MLP of its rows ``inputs`` (the first
``num_shared`` in one padded product, ``RowProducts.project``'s convention)."""


def expert_mlp(mlp: Any, routing: ExpertRouting, rows: torch.Tensor, num_shared: int,
               products: RowProducts) -> torch.Tensor:
    """The MoE block's output for the step's ``rows`` ``[rows, hidden]``, the first
    ``num_shared`` in shared products (``RowProducts.project``'s convention): Qwen3-MoE's
    router (a softmax over every expert, then the top k, renormalised where ``normalize``) and
    gated experts (gate | up in halves, ``act_fn(gate) * up``), and Qwen3-Next's gated shared
    expert added last where ``routing.shared_expert``; Granite 4.0-H's router (the top k
    scores softmaxed among themselves) and dense shared MLP where ``routing`` says so."""
    logits = products.project(mlp.gate, rows, num_shared)
    if routing.softmax_of_top_k:  # Granite 4.0-H's: the top k scores, then their softmax
        top_logits, top_experts = torch.topk(logits.float(), routing.top_k, dim=-1)
        top_weights = torch.softmax(top_logits, dim=-1)
    else:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_experts = torch.topk(probs, routing.top_k, dim=-1)
        if routing.normalize:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    experts = mlp.experts

    def run(expert: int, inputs: torch.Tensor, count: int) -> torch.Tensor:
        gate, up = products.project(ExpertProjection(experts.gate_up_proj[expert]), inputs,
                                    count).chunk(2, dim=-1)
        hidden = experts.act_fn(gate) * up
        out: torch.Tensor = products.project(ExpertProjection(experts.down_proj[expert]),
                                             hidden, count)
        return out

    routed = sum_over_experts(rows, top_weights.to(logits.dtype), top_experts, num_shared,
                              products, run)
    if routing.shared_mlp:  # every token's, unweighted (Granite 4.0-H)
        dense_mlp = mlp.shared_mlp
        gate, up = products.project(dense_mlp.input_linear, rows, num_shared).chunk(2, dim=-1)
        added: torch.Tensor = routed + products.project(
            dense_mlp.output_linear, dense_mlp.activation(gate) * up, num_shared)
        return added
    if not routing.shared_expert:
        return routed
    shared = mlp.shared_expert  # every token's, gated per token (Qwen3-Next)
    gated = (shared.act_fn(products.project(shared.gate_proj, rows, num_shared))
             * products.project(shared.up_proj, rows, num_shared))
    dense = products.project(shared.down_proj, gated, num_shared)
    weight = by_row(torch.sigmoid, products.project(mlp.shared_expert_gate, rows, num_shared))
    out: torch.Tensor = routed + weight * dense
    return out


def sum_over_experts(rows: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor,
                     num_shared: int, products: RowProducts, run: ExpertRun) -> torch.Tensor:
    """Each row's chosen experts' outputs (``run``), weighted by ``top_weights`` and summed in
    ascending expert order, as transformers adds them; each expert's rows from the shared part
    padded to a count that keeps their bits, the rows alone after them.

    Args:
        rows: the step's rows ``[rows, hidden]``, the first ``num_shared`` shared.
        top_weights: each row's weight of its chosen experts ``[rows, top_k]``.
        top_experts: each row's chosen experts ``[rows, top_k]``.
        num_shared: rows in shared products.
        products: the row products (their padding).
        run: one expert's MLP.
    """
    out = torch.zeros_like(rows)
    for expert in torch.unique(top_experts).tolist():  # ascending: the order of the sums
        row_index, slot = torch.where(top_experts == expert)
        shared = row_index < num_shared
        inputs, count = _padded(rows, row_index[shared], row_index[~shared], products)
        outputs = run(expert, inputs, count)
        real = torch.cat([outputs[:int(shared.sum())], outputs[count:]])
        order = torch.cat([row_index[shared], row_index[~shared]])
        slots = torch.cat([slot[shared], slot[~shared]])
        out.index_add_(0, order, real * top_weights[order, slots, None])
    return out


def _padded(rows: torch.Tensor, shared: torch.Tensor, alone: torch.Tensor,
            products: RowProducts) -> tuple[torch.Tensor, int]:
    """An expert's rows: those from the shared part padded with zero rows to a count that keeps
    their bits (the count returned), then those computed alone."""
    count = products.padding.rows_for(int(shared.numel())) if shared.numel() else 0
    padding = rows.new_zeros(count - int(shared.numel()), rows.shape[1])
    return torch.cat([rows[shared], padding, rows[alone]]), count


def expert_weights(mlp: Any) -> list[torch.Tensor]:
    """One expert's weights of an MoE block and its router's (and its shared expert's and that
    one's gate, where it has them): the shapes its products take."""
    experts = mlp.experts
    weights = [mlp.gate.weight, experts.gate_up_proj[0], experts.down_proj[0]]
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        weights += [shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight,
                    mlp.shared_expert_gate.weight]
    dense = getattr(mlp, "shared_mlp", None)
    if dense is not None:
        weights += [dense.input_linear.weight, dense.output_linear.weight]
    return weights
