"""Checks every family of Llama-shaped decoders makes of a config: the parts of the layer walk
that no family changes, so a config that changes them is refused in one line, never walked."""

from __future__ import annotations

from typing import Any


def rotary_problem(config: Any) -> str | None:
    """A rotation over only part of each head (``partial_rotary_factor`` < 1) is not the
    forward's: it rotates whole heads."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    factor = (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) \
        or getattr(config, "partial_rotary_factor", None) or 1.0
    if factor != 1.0:
        return f"partial rotary embeddings (partial_rotary_factor {factor})"
    return None


def sliding_window_problem(config: Any) -> str | None:
    """For a family whose windows are not read yet: layers that attend to the last window of
    positions only."""
    kinds = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" in kinds:
        return "sliding-window attention layers (layer_types)"
    return None


def window_problem(config: Any) -> str | None:
    """What of a config's attention spans ``layer_windows`` cannot say: chunked attention
    (Llama 4's blocks of positions), or sliding layers without a window size."""
    kinds = set(getattr(config, "layer_types", None) or ())
    others = kinds - {"full_attention", "sliding_attention"}
    if others:
        return f"attention layers of kinds {sorted(others)}"
    if "sliding_attention" in kinds and not getattr(config, "sliding_window", None):
        return "sliding-window layers (layer_types) without a sliding_window size"
    return None


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window (``LayerFeatures.window``), as transformers' masks read the
    config: where it lists ``layer_types``, ``sliding_window`` on its "sliding_attention"
    layers; where it lists none, ``sliding_window`` (if set) on every layer (Mistral)."""
    num_layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None) or None
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return tuple(window if kind == "sliding_attention" else None for kind in kinds)
    return (window,) * num_layers


def first_problem(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)
