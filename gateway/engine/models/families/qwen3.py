"""Qwen3 (``Qwen3ForCausalLM``): Llama's layer with q and k normalised per head before their
rotation (``q_norm``, ``k_norm``), and with ``use_sliding_window`` a sliding window on the layers
from ``max_window_layers`` on (``layer_types``, as transformers fills it in). Read through
transformers' ``from_pretrained``, so its config takes transformers' own defaults."""

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
class Qwen3Family:
    name: str = "qwen3"
    architectures: tuple[str, ...] = ("Qwen3ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(qk_norm=True, window=window) for window in layer_windows(config)))


QWEN3 = Qwen3Family()
