"""Phi-3 (``Phi3ForCausalLM``): Llama's layer with q, k and v in one projection
(``self_attn.qkv_proj``) and the MLP's gate and up in one (``mlp.gate_up_proj``), and where the
config sets ``sliding_window`` every layer attending the last ``sliding_window`` positions
(transformers' mask for it, as Mistral's), and where ``partial_rotary_factor`` is below 1 only
the first part of each head rotated. Its long-context checkpoints' ``longrope`` (Phi-3 128k,
Phi-3.5, Phi-4-mini) is refused (``common.rotary_frequencies_problem``). Read through
transformers' ``from_pretrained``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    first_problem,
    layer_windows,
    rotary_frequencies_problem,
    window_problem,
)


@dataclass(frozen=True, slots=True)
class Phi3Family:
    name: str = "phi3"
    architectures: tuple[str, ...] = ("Phi3ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        # A partial rotation (partial_rotary_factor) is Phi-3's own: the first part of each
        # head turned in halves, the rest passed, as the forward does for narrower tables.
        return first_problem(rotary_frequencies_problem(config), window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(window=window, fused_qkv=True, fused_gate_up=True)
            for window in layer_windows(config)))


PHI3 = Phi3Family()
