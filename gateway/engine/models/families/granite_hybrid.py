"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``): most layers a Mamba-2 mixer (``mamba``: a
recurrent layer whose state is its SSM state per head and its short convolution's window), a
few attention layers scaled by ``attention_multiplier`` and, unless
``position_embedding_type`` is ``rope``, not rotated at all (NoPE); every layer's MLP a sparse
mixture of experts (its router's top k scores softmaxed among themselves) plus a dense shared
MLP of every token (``shared_mlp``, gate | up in one product), or the shared MLP alone where a
model has no experts. Granite's multipliers: the embeddings times ``embedding_multiplier``,
each sublayer's output times ``residual_multiplier`` before its residual add, the logits
divided by ``logits_scaling``. Read through transformers' ``from_pretrained``; walked under
Llama's names (``module_tree``), the Mamba-2 states kept in the blocks
(``gateway.engine.forward.kept_states``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gateway.engine.forward.features import DecoderFeatures, ExpertRouting, LayerFeatures
from gateway.engine.models.families.common import first_problem, rotary_problem
from gateway.engine.models.families.named_tree import renamed_model

MAMBA = "linear_attention"
ATTENTION = "full_attention"
KIND_NAMES = {"mamba": MAMBA, "attention": ATTENTION, MAMBA: MAMBA, ATTENTION: ATTENTION}
"""``layer_types`` as configs write them (``mamba``/``attention``, or transformers' names)."""


@dataclass(frozen=True, slots=True)
class GraniteHybridFamily:
    name: str = "granite_hybrid"
    architectures: tuple[str, ...] = ("GraniteMoeHybridForCausalLM",)

    def problem(self, config: Any) -> str | None:
        raw = [str(kind) for kind in config.layer_types]
        unknown = sorted({kind for kind in raw if kind not in KIND_NAMES})
        heads, groups = int(config.mamba_n_heads), int(config.mamba_n_groups)
        return first_problem(
            f"layers of kinds {unknown} (layer_types)" if unknown else None,
            (f"{heads} Mamba-2 heads do not share {groups} groups evenly"
             if groups < 1 or heads % groups else None),
            rotary_problem(config) if _rotates(config) else None)

    def features(self, config: Any) -> DecoderFeatures:
        experts = int(getattr(config, "num_local_experts", 0) or 0)
        routing = (ExpertRouting(top_k=int(config.num_experts_per_tok), normalize=False,
                                 softmax_of_top_k=True, shared_mlp=True) if experts else None)
        residual = float(config.residual_multiplier)
        layers = []
        for kind in _layer_types(config):
            if kind == MAMBA:
                layers.append(LayerFeatures(mixer="mamba2", experts=routing,
                                            fused_gate_up=routing is None,
                                            residual_multiplier=residual))
            else:
                layers.append(LayerFeatures(attention_scale=float(config.attention_multiplier),
                                            rotary=_rotates(config), experts=routing,
                                            fused_gate_up=routing is None,
                                            residual_multiplier=residual))
        return DecoderFeatures(family=self.name, layers=tuple(layers),
                               embedding_multiplier=float(config.embedding_multiplier),
                               logits_divisor=float(config.logits_scaling))

    def module_tree(self, model: Any) -> nn.Module:
        """``model``'s modules (none copied) under the names the batched forward walks: each
        layer's ``mamba`` as ``mixer``; its MoE's ``router`` as ``mlp.gate`` beside
        ``mlp.experts`` and ``mlp.shared_mlp``, or, without experts, the shared MLP's
        ``input_linear``/``output_linear``/``activation`` as ``mlp.gate_up_proj``/
        ``down_proj``/``activation_fn``."""
        return renamed_model(model, _layer, model.model.norm)


def _layer(layer: Any) -> nn.Module:
    named = nn.Module()
    named.input_layernorm = layer.input_layernorm
    named.post_attention_layernorm = layer.post_attention_layernorm
    if layer.mamba is not None:
        named.mixer = layer.mamba
    else:
        named.self_attn = layer.self_attn
    mlp = nn.Module()
    shared = layer.shared_mlp
    if layer.block_sparse_moe is not None:
        mlp.gate = layer.block_sparse_moe.router
        mlp.experts = layer.block_sparse_moe.experts
        mlp.shared_mlp = shared
    else:
        mlp.gate_up_proj, mlp.down_proj = shared.input_linear, shared.output_linear
        mlp.activation_fn = shared.activation
    named.mlp = mlp
    return named


def _layer_types(config: Any) -> list[str]:
    return [KIND_NAMES[str(kind)] for kind in config.layer_types]


def _rotates(config: Any) -> bool:
    return getattr(config, "position_embedding_type", None) == "rope"


GRANITE_HYBRID = GraniteHybridFamily()
