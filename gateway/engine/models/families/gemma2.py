"""Gemma 2 (``Gemma2ForCausalLM``): Gemma 3's layer without its per-head q/k norms and with one
rotation for every layer -- norms on both sides of attention and of the MLP ("sandwich"),
scores scaled by ``query_pre_attn_scalar ** -0.5``, local layers with a sliding window beside
global ones (``layer_types``: every other layer by default), embeddings scaled by the square
root of the width (the embedding module's own forward, which the forward calls) -- plus logit
soft-capping: each layer's scores squashed to ``attn_logit_softcapping * tanh(s / cap)``
before the softmax, and the output logits to ``final_logit_softcapping * tanh(x / cap)``.
Read through transformers' ``from_pretrained``. Bidirectional attention is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import GEMMA3_NORMS, DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    attention_softcap,
    bidirectional_problem,
    final_softcap,
    first_problem,
    layer_windows,
    rotary_problem,
    window_problem,
)


@dataclass(frozen=True, slots=True)
class Gemma2Family:
    name: str = "gemma2"
    architectures: tuple[str, ...] = ("Gemma2ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), window_problem(config),
                             bidirectional_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        scale = float(config.query_pre_attn_scalar) ** -0.5
        softcap = attention_softcap(config)
        layers = tuple(LayerFeatures(window=window, attention_scale=scale, norms=GEMMA3_NORMS,
                                     logit_softcap=softcap)
                       for window in layer_windows(config))
        return DecoderFeatures(family=self.name, layers=layers,
                               final_logit_softcap=final_softcap(config))


GEMMA2 = Gemma2Family()
