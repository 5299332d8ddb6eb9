"""Qwen3 (``Qwen3ForCausalLM``): Llama's layer with q and k normalised per head before their
rotation (``q_norm``, ``k_norm``). Read through transformers' ``from_pretrained``, so its config
takes transformers' own defaults. Sliding-window layers (``use_sliding_window``) are refused
until the attention backends keep windows (issue 43, item 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import (
    first_problem,
    rotary_problem,
    sliding_window_problem,
)


@dataclass(frozen=True, slots=True)
class Qwen3Family:
    name: str = "qwen3"
    architectures: tuple[str, ...] = ("Qwen3ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), sliding_window_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures.uniform(self.name, int(config.num_hidden_layers),
                                       LayerFeatures(qk_norm=True))


QWEN3 = Qwen3Family()
