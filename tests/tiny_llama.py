"""The ``tiny_llama`` harness piece: a seeded random Llama saved and loaded like a real one.

Vocabulary 512, hidden 64, 2 layers, 4 heads, 2 KV heads (docs/reliability.md, "Harness"), saved
with ``save_pretrained`` beside the offline test tokenizer and loaded back through
``gateway.engine.models.loading.load_model``, so tests exercise the real loading path in well under
a second.
Its outputs are meaningless; its arithmetic is a real transformer's, which is what parity tests
need.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.tokenizer_fixture import CHAT_TEMPLATE, make_hf_tokenizer

VOCAB = 512


def save_tiny_llama(directory: Path, *, seed: int = 0, chat_template: str = CHAT_TEMPLATE,
                    tied: bool = False, layers: int = 2, kv_heads: int = 2,
                    hidden: int = 64) -> Path:
    """Write a tiny random Llama checkpoint (weights from ``seed``, the tokenizer's template
    ``chat_template``; ``tied``: its logits head is its embeddings' table, as SmolLM2's;
    ``layers``, ``kv_heads`` and ``hidden`` where a test needs a bigger one) and return its
    directory."""
    tokenizer = make_hf_tokenizer(chat_template=chat_template)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
