"""SmolLM3 (``SmolLM3ForCausalLM``): Llama's layer with no rotary positions on some layers
("NoPE": ``no_rope_layers[i]`` is 0, every fourth layer by default), and with
``use_sliding_window`` a sliding window on the layers ``layer_types`` names (the NoPE ones, as
transformers fills it in). Read through transformers' ``from_pretrained``."""

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
class SmolLM3Family:
    name: str = "smollm3"
    architectures: tuple[str, ...] = ("SmolLM3ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return first_problem(rotary_problem(config), window_problem(config),
                             _rotary_layers_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(window=window, rotary=bool(has_rope))
            for window, has_rope in zip(layer_windows(config), config.no_rope_layers,
                                        strict=False)))


def _rotary_layers_problem(config: Any) -> str | None:
    """``no_rope_layers`` (1: the layer rotates, 0: NoPE) must say it of every layer."""
    flags = getattr(config, "no_rope_layers", None)
    if flags is None or len(flags) < int(config.num_hidden_layers):
        return (f"no_rope_layers ({flags}) does not say of each of its "
                f"{config.num_hidden_layers} layers whether it rotates")
    return None


SMOLLM3 = SmolLM3Family()
