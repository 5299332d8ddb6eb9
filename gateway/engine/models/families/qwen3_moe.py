"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (per-head q/k norms, optional sliding
windows) over a sparse mixture of experts in the layers ``decoder_sparse_step`` and
``mlp_only_layers`` say (a dense MLP in the others), routed to ``num_experts_per_tok`` experts
by a softmax, renormalised over them where ``norm_topk_prob``. Read through transformers'
``from_pretrained``; the experts run in ``gateway.engine.forward.experts``, batch-invariant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import DecoderFeatures, ExpertRouting, LayerFeatures
from gateway.engine.models.families.common import (
    first_problem,
    layer_windows,
    rotary_problem,
    window_problem,
)


@dataclass(frozen=True, slots=True)
class Qwen3MoeFamily:
    name: str = "qwen3_moe"
    architectures: tuple[str, ...] = ("Qwen3MoeForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        routing = ExpertRouting(top_k=int(config.num_experts_per_tok),
                                normalize=bool(config.norm_topk_prob))
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        sparse = [index not in dense and int(config.num_experts) > 0 and (index + 1) % step == 0
                  for index in range(int(config.num_hidden_layers))]
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(qk_norm=True, window=window, experts=routing if is_sparse else None)
            for window, is_sparse in zip(layer_windows(config), sparse, strict=True)))


QWEN3_MOE = Qwen3MoeFamily()
