"""gpt-oss (``GptOssForCausalLM``): Llama's layer with attention sinks (a learned logit per
query head in every softmax's denominator), biases on the q, k, v and o projections, sliding
windows on the layers ``layer_types`` marks (every other one), YaRN rotary positions (whose
``attention_scaling`` the rotary embedding's own tables carry, as transformers applies them),
rotary tables holding each frequency once, and a mixture of experts of its own in every layer
(``ClampedSwigluRouting``: a biased router, softmax over the top k, interleaved gate/up and a
clamped SwiGLU). Read through transformers' ``from_pretrained``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import ClampedSwigluRouting, DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    first_problem,
    layer_windows,
    rotary_problem,
    window_problem,
)


@dataclass(frozen=True, slots=True)
class GptOssFamily:
    name: str = "gpt_oss"
    architectures: tuple[str, ...] = ("GptOssForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        routing = ClampedSwigluRouting(top_k=int(config.num_experts_per_tok),
                                       alpha=float(config.swiglu_alpha),
                                       limit=float(config.swiglu_limit))
        return DecoderFeatures(family=self.name, rotary_frequencies_once=True, layers=tuple(
            LayerFeatures(window=window, experts=routing, sinks=True)
            for window in layer_windows(config)))


GPT_OSS = GptOssFamily()
