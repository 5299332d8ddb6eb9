"""Mistral (``MistralForCausalLM``): Llama's layer with, where the config sets
``sliding_window``, every layer attending the last ``sliding_window`` positions only (Mistral 7B
v0.1; later versions set none). Read through transformers' ``from_pretrained``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    first_problem,
    layer_windows,
    rotary_problem,
    window_problem,
)


@dataclass(frozen=True, slots=True)
class MistralFamily:
    name: str = "mistral"
    architectures: tuple[str, ...] = ("MistralForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(window=window) for window in layer_windows(config)))


MISTRAL = MistralFamily()
