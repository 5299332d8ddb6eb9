"""Qwen3.5 (``Qwen3_5ForCausalLM``, the text model): three of every four layers Gated DeltaNet
linear attention (``linear_attn``: a recurrent layer whose state is a matrix per value head and
a short convolution's window), every fourth full attention with q and k normalised per head,
the rotation over a quarter of each head, and its output gated (``q_proj`` gives each head a
query and a gate: ``LayerFeatures.output_gate``); every layer a gated MLP between pre-norms.
Its RMSNorms scale by ``1 + weight`` (the modules' own forward: the walk calls them). Read
through transformers' ``from_pretrained``; the forward walks the same modules, ``linear_attn``
named ``mixer`` (``module_tree``).

The states are kept in the blocks (``gateway.engine.forward.kept_states``): each linear layer's
at every block's end, in its own slots and extra layers of the cache's layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import first_problem, rotary_frequencies_problem
from gateway.engine.models.families.named_tree import renamed_model

LINEAR = "linear_attention"
ATTENTION = "full_attention"


@dataclass(frozen=True, slots=True)
class Qwen3_5Family:
    name: str = "qwen3_5"
    architectures: tuple[str, ...] = ("Qwen3_5ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        return deltanet_problem(config)

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(mixer="gated_deltanet") if kind == LINEAR
            else LayerFeatures(qk_norm=True, output_gate=True)
            for kind in layer_types(config)))

    def module_tree(self, model: Any) -> nn.Module:
        return deltanet_module_tree(model)


def deltanet_module_tree(model: Any) -> nn.Module:
    """``model``'s modules (none copied) under the names the batched forward walks: each
    linear layer's ``linear_attn`` as ``mixer``; every other name is Llama's already (Qwen3.5's
    and Qwen3-Next's)."""
    return renamed_model(model, _layer, model.model.norm)


def _layer(layer: Any) -> nn.Module:
    named = nn.Module()
    named.input_layernorm = layer.input_layernorm
    named.post_attention_layernorm = layer.post_attention_layernorm
    if hasattr(layer, "linear_attn"):
        named.mixer = layer.linear_attn
    else:
        named.self_attn = layer.self_attn
    named.mlp = layer.mlp
    return named


def layer_types(config: Any) -> list[str]:
    """Each layer's kind, ``linear_attention`` or ``full_attention`` (transformers fills them in
    from ``full_attention_interval`` where a config lists none)."""
    return [str(kind) for kind in config.layer_types]


def deltanet_problem(config: Any) -> str | None:
    """What of a Gated DeltaNet hybrid's config the batched forward cannot run (Qwen3.5's and
    Qwen3-Next's layers)."""
    kinds = set(layer_types(config))
    unknown = sorted(kinds - {LINEAR, ATTENTION})
    key_heads = int(getattr(config, "linear_num_key_heads", 0) or 0)
    value_heads = int(getattr(config, "linear_num_value_heads", 0) or 0)
    return first_problem(
        f"layers of kinds {unknown} (layer_types)" if unknown else None,
        (f"{value_heads} linear value heads do not share {key_heads} key heads evenly"
         if key_heads < 1 or value_heads % key_heads else None),
        rotary_frequencies_problem(config))


QWEN3_5 = Qwen3_5Family()
