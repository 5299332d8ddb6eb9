"""A module tree under transformers' Llama attribute names over another model's own modules:
how a family whose transformers model names its modules otherwise (LFM2's ``conv`` and
``feed_forward``, Qwen3.5's ``linear_attn``) hands the batched forward the walk it knows,
none of the weights copied (``gateway.engine.models.families.base.RenamedFamily``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class LlamaNamedTree(nn.Module):
    """A module tree with transformers' Llama attribute names over another model's modules
    (``config``, ``model.embed_tokens``, ``model.layers``, ``model.norm``,
    ``model.rotary_emb``, ``lm_head``)."""

    def __init__(self, config: Any, embed_tokens: nn.Module, lm_head: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self._embed_tokens = (embed_tokens,)  # a tuple: not registered a second time

    def get_input_embeddings(self) -> nn.Module:
        return self._embed_tokens[0]


def renamed_model(model: Any, layer: Callable[[Any], nn.Module], norm: nn.Module) -> nn.Module:
    """``model`` (a transformers ``*ForCausalLM``) under Llama's names: each decoder layer as
    ``layer`` names it, ``norm`` as the final norm, its embeddings, rotary embedding and head as
    they are."""
    inner = model.model
    tree = LlamaNamedTree(model.config, inner.embed_tokens, model.lm_head)
    tree.model.layers = nn.ModuleList(layer(each) for each in inner.layers)
    tree.model.norm = norm
    tree.model.rotary_emb = inner.rotary_emb
    return tree
