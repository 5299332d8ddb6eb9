"""OLMo 2 (``Olmo2ForCausalLM``): Llama's layer with its norms after the attention and the MLP
instead of before them (each output normalised, then added to the residual; no
``input_layernorm``), and q and k normalised over their whole projection, every head at once,
before they are split into heads and rotated. Read through transformers' ``from_pretrained``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import POST_NORMS, DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    first_problem,
    rotary_problem,
    sliding_window_problem,
)


@dataclass(frozen=True, slots=True)
class Olmo2Family:
    name: str = "olmo2"
    architectures: tuple[str, ...] = ("Olmo2ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), sliding_window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures.uniform(self.name, int(config.num_hidden_layers), LayerFeatures(
            qk_projection_norm=True, norms=POST_NORMS))


OLMO2 = Olmo2Family()
