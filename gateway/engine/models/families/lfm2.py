"""LFM2 (``Lfm2ForCausalLM``): most layers a short gated convolution (``conv``: a recurrent layer
whose state is its last ``conv_L_cache - 1`` inputs), a few attention layers with q and k
normalised per head (``q_layernorm``, ``k_layernorm``) before a whole-head rotation; every layer
a gated MLP (``feed_forward``: ``w1`` the gate, ``w3`` up, ``w2`` down) between pre-norms
(``operator_norm``, ``ffn_norm``), a final ``embedding_norm``. Read through transformers'
``from_pretrained``; the forward walks the same modules under Llama's names (``module_tree``).

The convolution windows are kept in the blocks (``gateway.engine.forward.kept_states``): a warm
start resumes each conv layer from its cached prefix's last block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.models.families.common import first_problem, rotary_problem
from gateway.engine.models.families.named_tree import renamed_model

CONV = "conv"
ATTENTION = "full_attention"


@dataclass(frozen=True, slots=True)
class Lfm2Family:
    name: str = "lfm2"
    architectures: tuple[str, ...] = ("Lfm2ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        kinds = set(_layer_types(config))
        unknown = sorted(kinds - {CONV, ATTENTION})
        return first_problem(
            rotary_problem(config),
            f"layers of kinds {unknown} (layer_types)" if unknown else None)

    def features(self, config: Any) -> DecoderFeatures:
        return DecoderFeatures(family=self.name, layers=tuple(
            LayerFeatures(mixer="lfm2_conv") if kind == CONV else LayerFeatures(qk_norm=True)
            for kind in _layer_types(config)))

    def module_tree(self, model: Any) -> nn.Module:
        """``model``'s modules (none copied) under the names the batched forward walks: each
        layer's ``operator_norm`` as ``input_layernorm``, ``ffn_norm`` as
        ``post_attention_layernorm``, ``conv`` as ``mixer``, the attention's ``out_proj`` as
        ``o_proj`` and its ``q/k_layernorm`` as ``q/k_norm``, the MLP's ``w1/w3/w2`` as
        ``gate/up/down_proj``; ``embedding_norm`` as the final ``norm``."""
        return renamed_model(model, _layer, model.model.embedding_norm)


def _layer(layer: Any) -> nn.Module:
    named = nn.Module()
    named.input_layernorm = layer.operator_norm
    named.post_attention_layernorm = layer.ffn_norm
    if hasattr(layer, "conv"):
        named.mixer = layer.conv
    else:
        attention = nn.Module()
        source = layer.self_attn
        attention.q_proj, attention.k_proj = source.q_proj, source.k_proj
        attention.v_proj, attention.o_proj = source.v_proj, source.out_proj
        attention.q_norm, attention.k_norm = source.q_layernorm, source.k_layernorm
        named.self_attn = attention
    mlp = nn.Module()
    ff = layer.feed_forward
    mlp.gate_proj, mlp.up_proj, mlp.down_proj = ff.w1, ff.w3, ff.w2
    mlp.act_fn = nn.SiLU()
    named.mlp = mlp
    return named


def _layer_types(config: Any) -> list[str]:
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return [str(kind) for kind in kinds]
    num_layers = int(config.num_hidden_layers)
    attention = getattr(config, "full_attn_idxs", None)  # transformers' default: every layer
    attention = set(range(num_layers) if attention is None else attention)
    return [ATTENTION if i in attention else CONV for i in range(num_layers)]


LFM2 = Lfm2Family()
