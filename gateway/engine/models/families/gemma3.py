"""Gemma 3 (``Gemma3ForCausalLM``, text): per-head q/k norms, norms on both sides of attention and
of the MLP ("sandwich"), scores scaled by ``query_pre_attn_scalar ** -0.5``, local layers with a
sliding window and a rotation of their own base beside global ones (``layer_types``: five local
of every six by default), and embeddings scaled by the square root of the width (the embedding
module's own forward, which the forward calls). Read through transformers' ``from_pretrained``.
Logit soft-capping (Gemma 2's, a Gemma 3 config may set it) and bidirectional attention are
refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import GEMMA3_NORMS, DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    first_problem,
    layer_windows,
    rotary_problem,
    window_problem,
)


def softcapping_problem(config: Any) -> str | None:
    """Scores or logits squashed through tanh (``attn_logit_softcapping``,
    ``final_logit_softcapping``): not in the forward yet."""
    names = [name for name in ("attn_logit_softcapping", "final_logit_softcapping")
             if getattr(config, name, None)]
    return f"logit soft-capping ({', '.join(names)})" if names else None


@dataclass(frozen=True, slots=True)
class Gemma3Family:
    name: str = "gemma3"
    architectures: tuple[str, ...] = ("Gemma3ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        bidirectional = ("bidirectional attention (use_bidirectional_attention)"
                         if getattr(config, "use_bidirectional_attention", False) else None)
        return first_problem(rotary_problem(config), window_problem(config),
                             softcapping_problem(config), bidirectional)

    def features(self, config: Any) -> DecoderFeatures:
        scale = float(config.query_pre_attn_scalar) ** -0.5
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(qk_norm=True, window=window, attention_scale=scale, rope=kind,
                          norms=GEMMA3_NORMS)
            for window, kind in zip(layer_windows(config), config.layer_types, strict=True)))


GEMMA3 = Gemma3Family()
