"""Checkpoints kvgate cannot serve exactly, refused in one line before their weights are read.

Why at the door: what the cache keeps for a prompt is each layer's K/V per token. A layer that
keeps a recurrent state instead (the linear-attention and state-space layers of hybrids: Jamba,
Bamba, Nemotron-H; LFM2's convolutions, Qwen3.5's and Qwen3-Next's Gated DeltaNet and Granite
4.0-H's and Falcon-H1's Mamba-2 are the exceptions, their states kept in the blocks:
``STATE_KEEPING_ARCHITECTURES``),
multi-head latent attention
in an architecture whose latents kvgate does not keep, or quantized weights would give a warm
answer that is not the cold one, or a traceback in the middle of start-up. Each is found from
the checkpoint's ``config.json`` alone (no transformers import, no weights read), and ``kvgate
serve`` ends with the message and exit status 2 before any tier is opened.

An architecture no family runs batched but whose layers are all attention is not refused here:
it runs the serial exact route (``gateway.engine.models.families.describe`` says why).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ATTENTION_LAYER_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""``layer_types`` values whose layers keep per-token K/V: what the cache holds."""

RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding",
                                   "mamba", "mamba2", "ssm", "recurrent"})
"""``layer_types`` values whose layers keep a recurrent state (transformers' names for them)."""

RECURRENT_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "bamba", "nemotron_h",
    "granitemoehybrid", "qwen3_next", "qwen3_5", "qwen3_5_moe", "recurrent_gemma", "rwkv",
    "xlstm", "zamba", "zamba2", "olmo_hybrid", "plamo2",
})
"""Model types made of recurrent layers, for configs that list no ``layer_types``."""

STATE_KEEPING_ARCHITECTURES = frozenset({"Lfm2ForCausalLM", "Qwen3_5ForCausalLM",
                                         "Qwen3NextForCausalLM", "GraniteMoeHybridForCausalLM",
                                         "FalconH1ForCausalLM"})
"""Architectures whose recurrent layers' states the cache keeps in their blocks
(``gateway.engine.forward.kept_states``; their family's module walks them): not refused here."""

LATENT_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM"})
"""Architectures with multi-head latent attention whose latents the cache holds
(``gateway.engine.models.families.deepseek_v3``): any other latent model is refused."""


def unservable_reason(directory: Path) -> str | None:
    """Why the checkpoint in ``directory`` cannot be served exactly, in one line; None when it
    can (or when its config cannot be read: loading then says what is wrong with it)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    if isinstance(text, dict):  # multimodal wrappers keep the decoder's config inside
        config = {**config, **text}
    return config_problem(config)


def config_problem(config: Mapping[str, Any]) -> str | None:
    """``unservable_reason`` of a parsed ``config.json``."""
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
        return (f"its weights are quantized ({method}): kvgate serves float weights only, since "
                "a quantized product's rows do not keep their bits whatever shares the step")
    layer_problem = _layer_kinds_problem(config)
    if layer_problem is not None:
        return layer_problem
    if config.get("kv_lora_rank"):
        architectures = set(config.get("architectures") or ())
        if not architectures & LATENT_ARCHITECTURES:
            named = ", ".join(sorted(architectures)) or "none named"
            return ("its attention is multi-head latent attention (kv_lora_rank) in an "
                    f"architecture kvgate does not walk ({named}); latent caches are kept for "
                    f"{', '.join(sorted(LATENT_ARCHITECTURES))} only")
        return None
    head_dim = config.get("head_dim")
    v_head_dim = config.get("v_head_dim")
    if v_head_dim is not None and head_dim is not None and v_head_dim != head_dim:
        return (f"its values have {v_head_dim} dimensions a head and its keys {head_dim}: the "
                "page pool holds K and V of one size")
    return None


def _layer_kinds_problem(config: Mapping[str, Any]) -> str | None:
    kinds = config.get("layer_types")
    if isinstance(kinds, list) and kinds:
        recurrent = [i for i, kind in enumerate(kinds) if kind in RECURRENT_LAYER_KINDS]
        if recurrent and set(config.get("architectures") or ()) & STATE_KEEPING_ARCHITECTURES:
            return None  # its family runs it; the blocks' room for the states is checked later
        if recurrent:
            named = sorted({str(kinds[i]) for i in recurrent})
            return (f"{len(recurrent)} of its {len(kinds)} layers keep a recurrent state "
                    f"({', '.join(named)}; layers {_span(recurrent)}) that the cache cannot "
                    "hold exactly yet: only attention layers' K/V are cached")
        unknown = sorted({str(kind) for kind in kinds} - ATTENTION_LAYER_KINDS)
        if unknown:
            return f"it has layers of kinds nothing in kvgate reads ({', '.join(unknown)})"
        return None
    model_type = str(config.get("model_type", ""))
    keeps = bool(set(config.get("architectures") or ()) & STATE_KEEPING_ARCHITECTURES)
    if model_type in RECURRENT_MODEL_TYPES and not keeps:
        return (f"its layers ({model_type}) keep a recurrent state that the cache cannot hold "
                "exactly yet: only attention layers' K/V are cached")
    return None


def _span(indices: list[int]) -> str:
    """``0-2, 4`` for [0, 1, 2, 4]."""
    runs: list[str] = []
    start = previous = indices[0]
    for index in [*indices[1:], None]:
        if index is not None and index == previous + 1:
            previous = index
            continue
        runs.append(str(start) if start == previous else f"{start}-{previous}")
        if index is not None:
            start = previous = index
    return ", ".join(runs)
