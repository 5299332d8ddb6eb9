"""Gemma 3 (``Gemma3ForCausalLM``, text): per-head q/k norms, norms on both sides of attention and
of the MLP ("sandwich"), scores scaled by ``query_pre_attn_scalar ** -0.5``, local layers with a
sliding window and a rotation of their own base beside global ones (``layer_types``: five local
of every six by default), and embeddings scaled by the square root of the width (the embedding
module's own forward, which the forward calls); where a config sets ``final_logit_softcapping``,
the output logits soft-capped as Gemma 2's are. Its config also takes Gemma 2's
``attn_logit_softcapping``, which transformers' Gemma 3 attention never reads (it passes no
soft-cap to its attention): the scores are not capped here either, so that the batched route
computes what the model is. Read through transformers' ``from_pretrained``. Bidirectional
attention is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import GEMMA3_NORMS, DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    bidirectional_problem,
    final_softcap,
    first_problem,
    layer_windows,
    rotary_problem,
    window_problem,
)


@dataclass(frozen=True, slots=True)
class Gemma3Family:
    name: str = "gemma3"
    architectures: tuple[str, ...] = ("Gemma3ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), window_problem(config),
                             bidirectional_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        scale = float(config.query_pre_attn_scalar) ** -0.5
        layers = tuple(
            LayerFeatures(qk_norm=True, window=window, attention_scale=scale, rope=kind,
                          norms=GEMMA3_NORMS)
            for window, kind in zip(layer_windows(config), config.layer_types, strict=True))
        return DecoderFeatures(family=self.name, layers=layers,
                               final_logit_softcap=final_softcap(config))


GEMMA3 = Gemma3Family()
