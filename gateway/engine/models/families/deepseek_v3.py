"""DeepSeek-V3 (``DeepseekV3ForCausalLM``; Kimi K2 and DeepSeek-R1 share its shape): multi-head
latent attention in every layer (``LatentAttention``: queries through their own low-rank
``q_a_proj``/``q_b_proj`` where ``q_lora_rank`` is set, one latent and one shared rotary key a
token, rotary numbers in neighbouring pairs where ``rope_interleave``), a dense MLP in the first
``first_k_dense_replace`` layers and DeepSeek's mixture of experts in the rest
(``GroupLimitedRouting`` plus shared experts). The scores' scale is ``qk_head_dim ** -0.5``,
times YaRN's mscale squared where the rotary embedding is scaled with ``mscale_all_dim``, as
transformers scales them. Read through transformers' ``from_pretrained``.

The cache holds each token's latent and rotary key (``gateway.engine.kv.latent``): a token costs
``(kv_lora_rank + qk_rope_head_dim) x layers`` numbers, what the model's own cache holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import (
    DecoderFeatures,
    GroupLimitedRouting,
    LatentAttention,
    LayerFeatures,
)
from gateway.engine.models.families.common import first_problem, rotary_frequencies_problem


@dataclass(frozen=True, slots=True)
class DeepseekV3Family:
    name: str = "deepseek_v3"
    architectures: tuple[str, ...] = ("DeepseekV3ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        width = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
        odd = (f"a latent of {width} numbers a token (kv_lora_rank + qk_rope_head_dim), which "
               "does not split over the pages' K and V halves" if width % 2 else None)
        groups = int(config.n_group or 1)
        uneven = (f"{config.n_routed_experts} experts do not fall into {groups} groups evenly"
                  if int(config.n_routed_experts or 0) % groups else None)
        return first_problem(rotary_frequencies_problem(config), odd, uneven)

    def features(self, config: Any) -> DecoderFeatures:
        latent = LatentAttention(rank=int(config.kv_lora_rank),
                                 rope_dim=int(config.qk_rope_head_dim),
                                 nope_dim=int(config.qk_nope_head_dim),
                                 value_dim=int(config.v_head_dim),
                                 query_rank=(int(config.q_lora_rank)
                                             if config.q_lora_rank is not None else None))
        routing = GroupLimitedRouting(top_k=int(config.num_experts_per_tok),
                                      groups=int(config.n_group or 1),
                                      top_groups=int(config.topk_group or 1),
                                      normalize=bool(config.norm_topk_prob),
                                      scale=float(config.routed_scaling_factor))
        scale = latent_attention_scale(config)
        interleaved = bool(getattr(config, "rope_interleave", False))
        dense = int(config.first_k_dense_replace or 0)
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(latent=latent, attention_scale=scale, rotary_interleaved=interleaved,
                          experts=routing if index >= dense else None)
            for index in range(int(config.num_hidden_layers))))


def latent_attention_scale(config: Any) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's mscale squared where the rotary embedding is
    scaled with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = float((int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = float(rope["factor"])
        mscale = 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0 if factor > 1 \
            else 1.0
        scale *= mscale * mscale
    return scale


DEEPSEEK_V3 = DeepseekV3Family()
