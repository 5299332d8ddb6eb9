"""Qwen3-Next (``Qwen3NextForCausalLM``): Qwen3.5's layers -- Gated DeltaNet linear attention
in three of every four (its projections grouped per key head: ``in_proj_qkvz``,
``in_proj_ba``), gated full attention in the fourth -- over Qwen3-MoE's sparse mixture of
experts with a shared expert beside it: a dense MLP of every token added to the routed experts'
sum, weighted by ``sigmoid(shared_expert_gate(x))`` (``ExpertRouting.shared_expert``); the
layers ``decoder_sparse_step`` and ``mlp_only_layers`` exclude have a dense MLP. Read through
transformers' ``from_pretrained``; walked as Qwen3.5's (``linear_attn`` as ``mixer``), its
states kept in the blocks (``gateway.engine.forward.kept_states``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gateway.engine.forward.features import DecoderFeatures, ExpertRouting, LayerFeatures
from gateway.engine.models.families.qwen3_5 import (
    LINEAR,
    deltanet_module_tree,
    deltanet_problem,
    layer_types,
)


@dataclass(frozen=True, slots=True)
class Qwen3NextFamily:
    name: str = "qwen3_next"
    architectures: tuple[str, ...] = ("Qwen3NextForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return deltanet_problem(config)

    def features(self, config: Any) -> DecoderFeatures:
        routing = ExpertRouting(top_k=int(config.num_experts_per_tok),
                                normalize=bool(config.norm_topk_prob), shared_expert=True)
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        layers = []
        for index, kind in enumerate(layer_types(config)):
            sparse = (index not in dense and int(config.num_experts) > 0
                      and (index + 1) % step == 0)
            experts = routing if sparse else None
            layers.append(LayerFeatures(mixer="gated_deltanet", experts=experts) if kind == LINEAR
                          else LayerFeatures(qk_norm=True, output_gate=True, experts=experts))
        return DecoderFeatures(family=self.name, layers=tuple(layers))

    def module_tree(self, model: Any) -> nn.Module:
        return deltanet_module_tree(model)


QWEN3_NEXT = Qwen3NextFamily()
