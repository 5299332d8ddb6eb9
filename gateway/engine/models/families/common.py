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
    """Layers that attend to the last window of positions only (not yet in the forward)."""
    kinds = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" in kinds:
        return "sliding-window attention layers (layer_types)"
    return None


def first_problem(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)
