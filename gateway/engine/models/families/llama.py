"""Llama (``LlamaForCausalLM``): the plain layer the forward walks, and the family read without
transformers (``gateway.engine.models.llama_checkpoint``). SmolLM2, the bundled model, is one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    rotary_problem,
)


@dataclass(frozen=True, slots=True)
class LlamaFamily:
    name: str = "llama"
    architectures: tuple[str, ...] = ("LlamaForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return rotary_problem(config)

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures.uniform(self.name, int(config.num_hidden_layers), LayerFeatures())


LLAMA = LlamaFamily()
