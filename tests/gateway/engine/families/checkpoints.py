"""Tiny random checkpoints of every registered model family, built the way users' checkpoints
are made: the family's transformers config class, ``from_config``, ``save_pretrained``, beside
the offline test tokenizer. Nothing is downloaded.

Every family in ``gateway.engine.models.families.FAMILIES`` needs a builder here: the conformance
suite asserts it, so a family cannot be registered without running the suite.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    FalconH1Config,
    Gemma2Config,
    Gemma3TextConfig,
    Glm4Config,
    GptOssConfig,
    GraniteMoeHybridConfig,
    Lfm2Config,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3NextConfig,
    SmolLM3Config,
)

from tests.tokenizer_fixture import make_hf_tokenizer

LAYERS = 3
"""Enough layers that a family's per-layer features (a window on some, not others) show."""
WINDOW = 24
"""A sliding window shorter than the suite's prompts (70 tokens and more), so that it masks."""
ATTENTION_SOFTCAP = 0.25
"""A soft-cap on the scores that bites on a tiny random model, whose scaled scores are about
0.1 in magnitude (Gemma 2's cap is 50): left out, the tiny Gemma 2's last logits move by ~6e-3,
six times test_features_matter's FAR."""
FINAL_SOFTCAP = 0.5
"""A soft-cap on the output logits that bites likewise (they are about 0.3 in magnitude)."""


def _shape(tokenizer: Any) -> dict[str, Any]:
    """The sizes every tiny family shares: 64 wide, 4 heads of 16, 2 KV heads; the tokenizer's
    own vocabulary (no padded output rows the engine never samples and transformers would)."""
    return {
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 2048,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "tie_word_embeddings": False,
    }


def save_random(config: Any, directory: Path, tokenizer: Any, seed: int) -> Path:
    """``config``'s model with random weights, norms and biases, saved with ``tokenizer``."""
    torch.manual_seed(seed)
    auto: Any = AutoModelForCausalLM  # its from_config is unannotated
    model = auto.from_config(config, dtype=torch.float32)
    # Random norms and biases (transformers starts them at one and zero): a feature that is
    # skipped must show.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith((".bias", "_bias", ".sinks")):  # sinks: gpt-oss's, per head
                parameter.uniform_(-0.5, 0.5)
            elif name.endswith("gate.weight") and parameter.dim() == 2 and not parameter.any():
                parameter.normal_(0.0, 0.5)  # DeepSeek's router starts at zero
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's, for the choice only
                buffer.uniform_(-0.1, 0.1)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_llama(directory: Path, seed: int = 0) -> Path:
    tokenizer = make_hf_tokenizer()
    return save_random(LlamaConfig(**_shape(tokenizer)), directory, tokenizer, seed)


def save_qwen3(directory: Path, seed: int = 0) -> Path:
    tokenizer = make_hf_tokenizer()
    return save_random(Qwen3Config(**_shape(tokenizer)), directory, tokenizer, seed)


def save_qwen3_windowed(directory: Path, seed: int = 0) -> Path:
    """Qwen3 with ``use_sliding_window``: the layers from ``max_window_layers`` (1) on windowed,
    the first global."""
    tokenizer = make_hf_tokenizer()
    config = Qwen3Config(**_shape(tokenizer), use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1)
    return save_random(config, directory, tokenizer, seed)


def save_mistral(directory: Path, seed: int = 0) -> Path:
    tokenizer = make_hf_tokenizer()
    return save_random(MistralConfig(**_shape(tokenizer), sliding_window=WINDOW), directory,
                       tokenizer, seed)


def save_qwen3_moe(directory: Path, seed: int = 0) -> Path:
    """8 experts, 2 a token, renormalised; the first layer dense (``mlp_only_layers``)."""
    tokenizer = make_hf_tokenizer()
    config = Qwen3MoeConfig(**_shape(tokenizer), num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[0])
    return save_random(config, directory, tokenizer, seed)


def save_gemma3(directory: Path, seed: int = 0) -> Path:
    """Local (windowed, their own rotation base) and global layers alternating, scores scaled
    by a ``query_pre_attn_scalar`` other than the head size."""
    tokenizer = make_hf_tokenizer()
    shape = {**_shape(tokenizer), "tie_word_embeddings": True}
    config = Gemma3TextConfig(**shape, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"])
    config.architectures = ["Gemma3ForCausalLM"]
    return save_random(config, directory, tokenizer, seed)


def save_gemma3_softcapped(directory: Path, seed: int = 0) -> Path:
    """Gemma 3 with Gemma 2's logit soft-capping set: the output logits capped, the scores not
    (transformers' Gemma 3 attention never reads ``attn_logit_softcapping``)."""
    tokenizer = make_hf_tokenizer()
    shape = {**_shape(tokenizer), "tie_word_embeddings": True}
    config = Gemma3TextConfig(**shape, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              layer_types=["sliding_attention", "full_attention",
                                           "sliding_attention"],
                              attn_logit_softcapping=ATTENTION_SOFTCAP,
                              final_logit_softcapping=FINAL_SOFTCAP)
    config.architectures = ["Gemma3ForCausalLM"]
    return save_random(config, directory, tokenizer, seed)


def save_gemma2(directory: Path, seed: int = 0) -> Path:
    """Local (windowed) and global layers alternating as transformers' default
    ``layer_types`` has them, scores scaled by a ``query_pre_attn_scalar`` other than the head
    size, scores and output logits soft-capped at values that bite on a tiny model."""
    tokenizer = make_hf_tokenizer()
    shape = {**_shape(tokenizer), "tie_word_embeddings": True}
    config = Gemma2Config(**shape, sliding_window=WINDOW, query_pre_attn_scalar=24,
                          attn_logit_softcapping=ATTENTION_SOFTCAP,
                          final_logit_softcapping=FINAL_SOFTCAP)
    config.architectures = ["Gemma2ForCausalLM"]
    return save_random(config, directory, tokenizer, seed)


def save_qwen2(directory: Path, seed: int = 0) -> Path:
    """Biased q, k and v projections (Qwen2's own, always on)."""
    tokenizer = make_hf_tokenizer()
    return save_random(Qwen2Config(**_shape(tokenizer)), directory, tokenizer, seed)


def save_qwen2_windowed(directory: Path, seed: int = 0) -> Path:
    """Qwen2 with ``use_sliding_window``: the layers from ``max_window_layers`` (1) on windowed."""
    tokenizer = make_hf_tokenizer()
    config = Qwen2Config(**_shape(tokenizer), use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1)
    return save_random(config, directory, tokenizer, seed)


def save_smollm3(directory: Path, seed: int = 0) -> Path:
    """The middle layer NoPE (``no_rope_layers`` 0), the others rotating."""
    tokenizer = make_hf_tokenizer()
    return save_random(SmolLM3Config(**_shape(tokenizer), no_rope_layers=[1, 0, 1],
                                     pad_token_id=None), directory, tokenizer, seed)


def save_smollm3_windowed(directory: Path, seed: int = 0) -> Path:
    """SmolLM3 with ``use_sliding_window``: its NoPE layer windowed, as transformers fills in
    ``layer_types``."""
    tokenizer = make_hf_tokenizer()
    config = SmolLM3Config(**_shape(tokenizer), no_rope_layers=[1, 0, 1], pad_token_id=None,
                           use_sliding_window=True, sliding_window=WINDOW)
    return save_random(config, directory, tokenizer, seed)


def save_olmo2(directory: Path, seed: int = 0) -> Path:
    tokenizer = make_hf_tokenizer()
    return save_random(Olmo2Config(**_shape(tokenizer), pad_token_id=None), directory, tokenizer,
                       seed)


def save_phi3(directory: Path, seed: int = 0) -> Path:
    """Fused qkv_proj and gate_up_proj; a sliding window on every layer, as Phi-3 mini 4k's."""
    tokenizer = make_hf_tokenizer()
    config = Phi3Config(**_shape(tokenizer), pad_token_id=None, sliding_window=WINDOW)
    return save_random(config, directory, tokenizer, seed)


def save_glm4(directory: Path, seed: int = 0) -> Path:
    """Sandwich norms, biased q/k/v, fused gate_up_proj, half of each head rotated in pairs
    (transformers' default ``partial_rotary_factor`` 0.5)."""
    tokenizer = make_hf_tokenizer()
    return save_random(Glm4Config(**_shape(tokenizer), pad_token_id=None), directory, tokenizer,
                       seed)


def save_phi3_partial(directory: Path, seed: int = 0) -> Path:
    """Phi-3 rotating the first half of each head only (``partial_rotary_factor``), no window."""
    tokenizer = make_hf_tokenizer()
    partial: dict[str, Any] = {"partial_rotary_factor": 0.5}  # a kwarg its config reads
    config = Phi3Config(**_shape(tokenizer), pad_token_id=None, **partial)
    return save_random(config, directory, tokenizer, seed)


def save_gpt_oss(directory: Path, seed: int = 0) -> Path:
    """Attention sinks, biased q/k/v/o, windowed and global layers alternating (a window of
    16), 4 experts of which a token takes 2, YaRN positions scaled from 64 to 2,048 (on a base
    of 10,000, not its 150,000: over a tiny prompt, positions then turn heads far enough to
    show)."""
    tokenizer = make_hf_tokenizer()
    shape = {**_shape(tokenizer), "intermediate_size": 48}
    rope: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False,
                            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    config = GptOssConfig(**shape, pad_token_id=None, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=GPT_OSS_WINDOW,
                          rope_parameters=rope)
    return save_random(config, directory, tokenizer, seed)


def save_deepseek_v3(directory: Path, seed: int = 0) -> Path:
    """Multi-head latent attention (a latent of 32 and a rotary key of 8 a token, queries
    through their own rank of 24, rotary numbers interleaved) in every layer; a dense first
    layer, then 8 experts in 4 groups, a token's 2 from its best 2 groups, renormalised and
    scaled, beside one shared expert; YaRN positions scaled 40x from 64 with ``mscale_all_dim``,
    so the scores' scale is not the head's (x 1.87)."""
    tokenizer = make_hf_tokenizer()
    shape = {**_shape(tokenizer), "num_key_value_heads": 4, "head_dim": 8}
    rope: dict[str, Any] = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0,
                            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    config = DeepseekV3Config(**shape, pad_token_id=None, moe_intermediate_size=32,
                              n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                              n_group=4, topk_group=2, first_k_dense_replace=1,
                              routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=24,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                              rope_interleave=True, rope_parameters=rope)
    return save_random(config, directory, tokenizer, seed)


GPT_OSS_WINDOW = 16
"""gpt-oss's sliding window in its tiny checkpoint: shorter than a tile of keys, so that a
window's first key falls inside the tiles and pages the kernels read."""


def save_lfm2(directory: Path, seed: int = 0) -> Path:
    """Short-convolution layers around one attention layer (the first and last conv), a conv
    bias, and conv windows of 3 inputs (``conv_L_cache``, LFM2's)."""
    tokenizer = make_hf_tokenizer()
    shape = {name: value for name, value in _shape(tokenizer).items() if name != "head_dim"}
    config = Lfm2Config(**shape, layer_types=["conv", "full_attention", "conv"],
                        conv_bias=True, conv_L_cache=3, block_auto_adjust_ff_dim=False)
    return save_random(config, directory, tokenizer, seed)


def save_qwen3_5(directory: Path, seed: int = 0) -> Path:
    """Gated DeltaNet layers around one gated full-attention layer (the first and last linear),
    value heads twice the key heads, and scan states larger than a 16-token block's slots of
    their layer (so that they take extra layers of the cache's layout)."""
    tokenizer = make_hf_tokenizer()
    config = Qwen3_5TextConfig(
        **_shape(tokenizer), layer_types=["linear_attention", "full_attention",
                                          "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, architectures=["Qwen3_5ForCausalLM"])
    return save_random(config, directory, tokenizer, seed)


def save_qwen3_next(directory: Path, seed: int = 0) -> Path:
    """Qwen3.5's layer pattern (Gated DeltaNet, gated attention, Gated DeltaNet; its
    projections grouped per key head) over four experts, two per token, with a gated shared
    expert; the attention layer's MLP dense (``mlp_only_layers``)."""
    tokenizer = make_hf_tokenizer()
    config = Qwen3NextConfig(
        **_shape(tokenizer), layer_types=["linear_attention", "full_attention",
                                          "linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
        architectures=["Qwen3NextForCausalLM"])
    return save_random(config, directory, tokenizer, seed)


def save_granite_hybrid(directory: Path, seed: int = 0) -> Path:
    """Granite 4.0-H's pattern (Mamba-2, attention, Mamba-2) over four experts, two per token,
    and a dense shared MLP; NoPE attention (no ``position_embedding_type``); Granite's
    multipliers, milder than Granite 4.0's (embeddings x12, residuals x0.22, logits / 8), so
    that every sublayer still moves a tiny random model's logits: embeddings x2, residuals
    x0.5, logits / 2, attention scaled by 1/16."""
    tokenizer = make_hf_tokenizer()
    shape = {name: value for name, value in _shape(tokenizer).items() if name != "head_dim"}
    config = GraniteMoeHybridConfig(
        **shape, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=2, mamba_expand=1, mamba_d_conv=4,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=96,
        embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0,
        attention_multiplier=0.0625, architectures=["GraniteMoeHybridForCausalLM"])
    return save_random(config, directory, tokenizer, seed)


def save_granite_hybrid_dense_rope(directory: Path, seed: int = 0) -> Path:
    """A Granite 4.0-H without experts (its shared MLP alone in every layer) whose attention is
    rotated (``position_embedding_type = "rope"``)."""
    tokenizer = make_hf_tokenizer()
    shape = {name: value for name, value in _shape(tokenizer).items() if name != "head_dim"}
    config = GraniteMoeHybridConfig(
        **shape, layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=16, mamba_n_groups=1, mamba_expand=1, num_local_experts=0,
        shared_intermediate_size=96, position_embedding_type="rope", embedding_multiplier=2.0,
        residual_multiplier=0.5, logits_scaling=2.0, attention_multiplier=0.0625,
        architectures=["GraniteMoeHybridForCausalLM"])
    return save_random(config, directory, tokenizer, seed)


def save_falcon_h1(directory: Path, seed: int = 3) -> Path:
    """Falcon-H1's layer: a Mamba-2 mixer beside the attention in each of three layers, every
    muP multiplier away from one (so that each one shows), the mixer's norm before its gate;
    seed 3, whose greedy answers run past the tests' lengths without an end token."""
    tokenizer = make_hf_tokenizer()
    shape = {name: value for name, value in _shape(tokenizer).items() if name != "head_dim"}
    config = FalconH1Config(
        **shape, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
        mamba_expand=1, mamba_d_ssm=64, mamba_d_conv=4, key_multiplier=4.0,
        attention_in_multiplier=0.8, attention_out_multiplier=1.5, ssm_out_multiplier=0.4,
        ssm_in_multiplier=1.3, ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.5],
        mlp_multipliers=[1.4, 0.7], embedding_multiplier=2.0, lm_head_multiplier=0.5,
        architectures=["FalconH1ForCausalLM"])
    return save_random(config, directory, tokenizer, seed)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "llama": save_llama,
    "qwen3": save_qwen3,
    "mistral": save_mistral,
    "qwen3_moe": save_qwen3_moe,
    "gemma3": save_gemma3,
    "qwen2": save_qwen2,
    "smollm3": save_smollm3,
    "olmo2": save_olmo2,
    "phi3": save_phi3,
    "glm4": save_glm4,
    "gpt_oss": save_gpt_oss,
    "gemma2": save_gemma2,
    "deepseek_v3": save_deepseek_v3,
    "lfm2": save_lfm2,
    "qwen3_5": save_qwen3_5,
    "qwen3_next": save_qwen3_next,
    "granite_hybrid": save_granite_hybrid,
    "falcon_h1": save_falcon_h1,
}
"""Family name -> a builder of its tiny checkpoint."""

VARIANTS: dict[str, Callable[[Path], Path]] = {
    "qwen3-windowed": save_qwen3_windowed,
    "qwen2-windowed": save_qwen2_windowed,
    "smollm3-windowed": save_smollm3_windowed,
    "phi3-partial": save_phi3_partial,
    "gemma3-softcapped": save_gemma3_softcapped,
    "granite_hybrid-dense-rope": save_granite_hybrid_dense_rope,
}
"""More checkpoints the suite runs, where a family has a feature its main checkpoint lacks
(name: family-feature)."""
