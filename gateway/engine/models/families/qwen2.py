"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): Llama's layer with biases on the q, k and v
projections (the row products add a ``Linear``'s bias, so nothing in the walk changes), and with
``use_sliding_window`` a sliding window on the layers from ``max_window_layers`` on
(``layer_types``, as transformers fills it in). Read through transformers' ``from_pretrained``."""

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
class Qwen2Family:
    name: str = "qwen2"
    architectures: tuple[str, ...] = ("Qwen2ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(window=window) for window in layer_windows(config)))


QWEN2 = Qwen2Family()
