"""DeepSeek-V3's mixture of experts in the batched forward (``GroupLimitedRouting``), each
token's numbers its own, as Qwen3-MoE's are (``gateway.engine.forward.experts``: the same padded
product per expert and the same sum in expert order).

What differs from Qwen3-MoE's, as transformers' ``DeepseekV3MoE`` computes it:

- the router scores in float32 through a sigmoid, not a softmax; each row's scores are a
  matrix-vector product and a sigmoid of their own, so no other row's presence changes them
  whatever the model's dtype (the router is small beside the experts);
- a token's experts are chosen group-limited: a per-expert correction bias is added for the
  choice only, the experts' groups ranked by the sum of their two best corrected scores, and
  the top k taken from the best ``top_groups`` groups; every step of it is row-wise;
- the chosen experts' uncorrected scores weigh them, renormalised and scaled;
- a dense ``shared_experts`` MLP of every token is added to the routed sum.
"""

from __future__ import annotations

from typing import Any

import torch

from gateway.engine.forward.experts import ExpertProjection, sum_over_experts
from gateway.engine.forward.features import GroupLimitedRouting
from gateway.engine.linear.row_products import RowProducts


def group_limited_mlp(mlp: Any, routing: GroupLimitedRouting, rows: torch.Tensor,
                      num_shared: int, products: RowProducts) -> torch.Tensor:
    """The MoE block's output for the step's ``rows`` ``[rows, hidden]``, the first
    ``num_shared`` in shared products (``RowProducts.project``'s convention)."""
    top_weights, top_experts = group_limited_choice(mlp.gate, routing, rows)
    experts = mlp.experts

    def run(expert: int, inputs: torch.Tensor, count: int) -> torch.Tensor:
        gate, up = products.project(ExpertProjection(experts.gate_up_proj[expert]), inputs,
                                    count).chunk(2, dim=-1)
        hidden = experts.act_fn(gate) * up
        out: torch.Tensor = products.project(ExpertProjection(experts.down_proj[expert]),
                                             hidden, count)
        return out

    routed = sum_over_experts(rows, top_weights.to(rows.dtype), top_experts, num_shared,
                              products, run)
    shared = mlp.shared_experts
    project = products.project
    gated = (shared.act_fn(project(shared.gate_proj, rows, num_shared))
             * project(shared.up_proj, rows, num_shared))
    out: torch.Tensor = routed + project(shared.down_proj, gated, num_shared)
    return out


def group_limited_choice(router: Any, routing: GroupLimitedRouting, rows: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's experts ``[rows, top_k]`` and their weights (float32), chosen as
    ``GroupLimitedRouting`` says."""
    weight = router.weight.detach().float()
    floats = rows.float()
    # Row by row, the sigmoid too: torch's element-wise kernels run a tensor's last partial
    # vector through other (scalar) code, so a row's sigmoid bits would depend on how many rows
    # came before it in the tensor (seen: 1 row beside 1 vs beside 15, 8 experts).
    scores = torch.stack([torch.mv(weight, floats[row]).sigmoid()
                          for row in range(rows.shape[0])])
    corrected = scores + router.e_score_correction_bias.float()
    num_experts = corrected.shape[-1]
    grouped = corrected.view(-1, routing.groups, num_experts // routing.groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(routing.top_groups, dim=-1).indices
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    allowed = allowed.unsqueeze(-1).expand_as(grouped).reshape(-1, num_experts)
    top_experts = corrected.masked_fill(~allowed, float("-inf")).topk(routing.top_k,
                                                                      dim=-1).indices
    top_weights = scores.gather(1, top_experts)
    if routing.normalize:
        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return top_weights * routing.scale, top_experts


def group_limited_weights(mlp: Any) -> list[torch.Tensor]:
    """One expert's weights and the shared experts': the shapes its shared products take (the
    router's products are each row's own, not padded)."""
    experts, shared = mlp.experts, mlp.shared_experts
    return [experts.gate_up_proj[0], experts.down_proj[0], shared.gate_proj.weight,
            shared.up_proj.weight, shared.down_proj.weight]
