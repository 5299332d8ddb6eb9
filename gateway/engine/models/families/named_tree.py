"""A module tree under transformers' Llama attribute names over another model's own modules:
how a family whose transformers model names its modules otherwise (LFM2's ``conv`` and
``feed_forward``, Qwen3.5's ``linear_attn``) hands the batched forward the walk it knows,
none of the weights copied (``gateway.engine.models.families.base.RenamedFamily``)."""

from __future__ import annotations

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
