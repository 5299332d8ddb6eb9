"""gpt-oss's mixture of experts in the batched forward (``ClampedSwigluRouting``), each token's
numbers its own, as Qwen3-MoE's are (``gateway.engine.forward.experts``: the same padded product
per expert and the same sum in expert order).

What differs from Qwen3-MoE's, as transformers' ``GptOssMLP`` computes it:

- the router is a ``Linear`` with a bias (``mlp.router``); a token's top k logits are chosen
  first and softmaxed among themselves (no softmax over every expert);
- the experts' weights are stored ``[experts, in, out]`` (``x @ w``), so each product reads a
  transposed view of its expert's slice (``projection_weights`` hands the route search the same
  views), each with its bias (``gate_up_proj_bias``, ``down_proj_bias``);
- gate and up are interleaved in the fused product's columns (gate the even ones, up the odd)
  and the activation is clamped: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
  with ``g = clamp(gate, max=limit)``.
"""

from __future__ import annotations

from typing import Any

import torch

from gateway.engine.forward.experts import ExpertProjection, sum_over_experts
from gateway.engine.forward.features import ClampedSwigluRouting
from gateway.engine.linear.row_products import RowProducts


def clamped_swiglu_mlp(mlp: Any, routing: ClampedSwigluRouting, rows: torch.Tensor,
                       num_shared: int, products: RowProducts) -> torch.Tensor:
    """The MoE block's output for the step's ``rows`` ``[rows, hidden]``, the first
    ``num_shared`` in shared products (``RowProducts.project``'s convention)."""
    logits = products.project(mlp.router, rows, num_shared)
    top_logits, top_experts = torch.topk(logits, routing.top_k, dim=-1)
    top_weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
    experts = mlp.experts

    def run(expert: int, inputs: torch.Tensor, count: int) -> torch.Tensor:
        gate_up = products.project(
            ExpertProjection(experts.gate_up_proj[expert].T, experts.gate_up_proj_bias[expert]),
            inputs, count)
        hidden = clamped_swiglu(gate_up, routing)
        out: torch.Tensor = products.project(
            ExpertProjection(experts.down_proj[expert].T, experts.down_proj_bias[expert]),
            hidden, count)
        return out

    return sum_over_experts(rows, top_weights, top_experts, num_shared, products, run)


def clamped_swiglu(gate_up: torch.Tensor, routing: ClampedSwigluRouting) -> torch.Tensor:
    """gpt-oss's activation of a fused product whose columns interleave gate and up."""
    gate = gate_up[..., ::2].clamp(max=routing.limit)
    up = gate_up[..., 1::2].clamp(min=-routing.limit, max=routing.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * routing.alpha))


def clamped_swiglu_weights(mlp: Any) -> list[torch.Tensor]:
    """The router's weight and one expert's, as its products take them (``[out, in]`` views):
    the shapes the start-up search pads."""
    experts = mlp.experts
    return [mlp.router.weight, experts.gate_up_proj[0].T, experts.down_proj[0].T]
