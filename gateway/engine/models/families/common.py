"""Checks every family of Llama-shaped decoders makes of a config: the parts of the layer walk
that no family changes, so a config that changes them is refused in one line, never walked."""

from __future__ import annotations

from typing import Any


def rotary_problem(config: Any) -> str | None:
    """A rotation over only part of each head (``partial_rotary_factor`` < 1), for a family
    whose transformers model rotates whole heads, or frequencies that change with the length."""
    rope = _rope_parameters(config)
    factor = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) \
        or 1.0
    if factor != 1.0:
        return f"partial rotary embeddings (partial_rotary_factor {factor})"
    return rotary_frequencies_problem(config)


def rotary_frequencies_problem(config: Any) -> str | None:
    """Frequencies transformers recomputes from the length (``LENGTH_DEPENDENT_ROPE_TYPES``)."""
    rope = _rope_parameters(config)
    # One rope's parameters, or one per layer type (Gemma 3's {"sliding_attention": {...}}).
    kinds = [rope.get("rope_type")] + [value.get("rope_type") for value in rope.values()
                                       if isinstance(value, dict)]
    kind = next((kind for kind in kinds if kind in LENGTH_DEPENDENT_ROPE_TYPES), None)
    if kind is not None:
        return (f"a rotary embedding whose frequencies change with the sequence's length "
                f"(rope_type {kind}): a position's keys would depend on how long the sequence "
                "grew, not on the position alone")
    return None


def _rope_parameters(config: Any) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return rope if isinstance(rope, dict) else {}


LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")
"""transformers' rope types that recompute their frequencies from the longest position in the
call (``dynamic_rope_update``): the forward's rotary tables, built once per chunk of positions,
and the cache's keys, computed once per position, cannot follow them."""


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


def bidirectional_problem(config: Any) -> str | None:
    """Every position attending every other (``use_bidirectional_attention``, Gemma's encoder
    use): the cache holds keys causal decoding reads."""
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention)"
    return None


def attention_softcap(config: Any) -> float | None:
    """The scores' logit soft-cap (``attn_logit_softcapping``, Gemma 2's ``LayerFeatures
    .logit_softcap``), or None where the config sets none."""
    cap = getattr(config, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def final_softcap(config: Any) -> float | None:
    """The output logits' soft-cap (``final_logit_softcapping``, ``DecoderFeatures
    .final_logit_softcap``), or None where the config sets none."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None
