"""The tiny random Llama (``tests.tiny_llama``) written as a float32 GGUF file.

The bundled model is a GGUF that takes ~15 s to convert; this one converts in well under a
second, so tests of the GGUF path (``gateway.engine.models.loading``'s conversion cache) need not
wait. Written with the ``gguf`` library (the one transformers reads GGUFs with); its weights are the
tiny Llama's, so transformers dequantises them back bit for bit (the q/k projections are stored
in GGUF's rotary order, which transformers undoes).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.tiny_llama import save_tiny_llama

_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def save_tiny_gguf(directory: Path, *, seed: int = 0) -> Path:
    """Write the tiny Llama of ``seed`` as ``directory/tiny.gguf`` and return the file's path
    (its checkpoint directory is left beside it, in ``directory/checkpoint``)."""
    checkpoint = save_tiny_llama(directory / "checkpoint", seed=seed)
    model = LlamaForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    config = model.config
    kv_heads, eos = config.num_key_value_heads, config.eos_token_id
    assert isinstance(kv_heads, int) and isinstance(eos, int)
    path = directory / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    by_id = {i: token for token, i in tokenizer.get_vocab().items()}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([by_id.get(i, f"<unused{i}>") for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(eos)
    writer.add_chat_template(tokenizer.chat_template)
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for layer in range(config.num_hidden_layers):
        for ours, theirs in _LAYER_NAMES.items():
            names[f"model.layers.{layer}.{ours}.weight"] = f"blk.{layer}.{theirs}.weight"
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = _rotary_order(array, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            array = _rotary_order(array, kv_heads)
        writer.add_tensor(names[name], np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _rotary_order(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's order of a q/k projection's rows (the inverse of transformers' undoing)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))
