"""Falcon-H1 (``FalconH1ForCausalLM``): in every layer a Mamba-2 mixer (``mamba``) and an
attention read the same normed input side by side -- the attention's input scaled by
``attention_in_multiplier`` -- and their outputs, scaled by ``ssm_out_multiplier`` and
``attention_out_multiplier``, are summed (``LayerFeatures.parallel``); the keys are scaled by
``key_multiplier`` before their rotation; a gated MLP (``feed_forward``) whose gate product is
scaled by ``mlp_multipliers[0]`` before its activation and its output by ``mlp_multipliers[1]``;
the embeddings scaled by ``embedding_multiplier`` and the logits by ``lm_head_multiplier``. The
mixer's own multipliers (``ssm_in_multiplier``, the per-column ``mup_vector``) and its norm
before, after or without the gate are the Mamba-2 kind's (``forward/recurrent/mamba2.py``). Read
through transformers' ``from_pretrained``; walked under Llama's names (``module_tree``). Every
layer's attention keeps its K/V in its own slots, so the mixer's state lies in extra layers of
the cache's layout (``gateway.engine.forward.kept_states``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from gateway.engine.forward.features import DecoderFeatures, LayerFeatures, ParallelMix
from gateway.engine.models.families.common import first_problem, rotary_problem
from gateway.engine.models.families.named_tree import renamed_model


@dataclass(frozen=True, slots=True)
class FalconH1Family:
    name: str = "falcon_h1"
    architectures: tuple[str, ...] = ("FalconH1ForCausalLM",)

    def problem(self, config: Any) -> str | None:
        heads, groups = int(config.mamba_n_heads), int(config.mamba_n_groups)
        inner = heads * int(config.mamba_d_head)
        d_ssm = getattr(config, "mamba_d_ssm", None)
        return first_problem(
            (f"{heads} Mamba-2 heads do not share {groups} groups evenly"
             if groups < 1 or heads % groups else None),
            (f"mamba_d_ssm {d_ssm} is not its {heads} heads x {config.mamba_d_head}"
             if d_ssm is not None and int(d_ssm) != inner else None),
            rotary_problem(config))

    def features(self, config: Any) -> DecoderFeatures:
        gate, down = (float(m) for m in config.mlp_multipliers)
        layer = LayerFeatures(
            mixer="mamba2",
            parallel=ParallelMix(attention_in=float(config.attention_in_multiplier),
                                 attention_out=float(config.attention_out_multiplier),
                                 mixer_out=float(config.ssm_out_multiplier)),
            key_multiplier=float(config.key_multiplier), mlp_multipliers=(gate, down))
        return DecoderFeatures(family=self.name, layers=(layer,) * int(config.num_hidden_layers),
                               embedding_multiplier=float(config.embedding_multiplier),
                               logits_multiplier=float(config.lm_head_multiplier))

    def module_tree(self, model: Any) -> nn.Module:
        """``model``'s modules (none copied) under the names the batched forward walks: each
        layer's ``mamba`` as ``mixer`` beside its ``self_attn``, ``pre_ff_layernorm`` as
        ``post_attention_layernorm``, ``feed_forward`` as ``mlp``; ``final_layernorm`` as the
        final ``norm``."""
        return renamed_model(model, _layer, model.model.final_layernorm)


def _layer(layer: Any) -> nn.Module:
    named = nn.Module()
    named.input_layernorm = layer.input_layernorm
    named.post_attention_layernorm = layer.pre_ff_layernorm
    named.mixer = layer.mamba
    named.self_attn = layer.self_attn
    named.mlp = layer.feed_forward
    return named


FALCON_H1 = FalconH1Family()
