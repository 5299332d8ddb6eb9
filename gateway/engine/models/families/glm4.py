"""GLM-4 (``Glm4ForCausalLM``, GLM-4-9B-0414 and its kin): Llama's layer with a norm before and
after each sublayer ("sandwich" norms: ``post_self_attn_layernorm`` on the attention's output,
``post_mlp_layernorm`` on the MLP's), biases on the q, k and v projections, the MLP's gate and
up in one projection (``gate_up_proj``), and a rotation of neighbouring pairs over the first
part of each head only (``partial_rotary_factor``, 0.5 by default). Read through transformers'
``from_pretrained``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import GLM4_NORMS, DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    first_problem,
    rotary_frequencies_problem,
    sliding_window_problem,
)


@dataclass(frozen=True, slots=True)
class Glm4Family:
    name: str = "glm4"
    architectures: tuple[str, ...] = ("Glm4ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        # A partial rotation is GLM-4's own (the forward rotates the tables' width of a head).
        return first_problem(rotary_frequencies_problem(config), sliding_window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures.uniform(self.name, int(config.num_hidden_layers), LayerFeatures(
            norms=GLM4_NORMS, fused_gate_up=True, rotary_interleaved=True))


GLM4 = Glm4Family()
