"""A checkpoint of Llama's layer (Llama, Qwen3) as a tree of torch modules, built without
transformers.

Why: the batched forward (``gateway.engine.forward.batched``) walks a model's modules itself and
calls only their weights, the two norms, the activation and the rotary embedding; loading
transformers' ``LlamaForCausalLM`` for that costs about 2 s of every start in imports alone.
This tree has exactly the attribute names that forward (and the engine) read --
``config``, ``model.embed_tokens``, ``model.layers[i].self_attn.{q,k,v,o}_proj`` (and Qwen3's
``self_attn.{q,k}_norm``),
``input_layernorm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``, ``mlp.act_fn``,
``model.norm``, ``model.rotary_emb``, ``lm_head``, ``get_input_embeddings()`` -- and the same
state-dict names, so transformers' model can later be built over the very same tensors
(``gateway.engine.models.transformers_api``).

NOTE: every computing module repeats transformers 5.23's op order exactly (``LlamaRMSNorm``,
``LlamaRotaryEmbedding`` with its ``default`` and ``_compute_llama3_parameters`` frequencies,
``SiLUActivation``): blocks cached by a gateway that loaded the model either way must stay
valid, so the two loads must agree bit for bit (tests/gateway/engine/test_llama_modules.py).
The tree has no forward of its own: it is only ever walked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from gateway.engine.forward.features import DecoderFeatures
from gateway.engine.models.llama_checkpoint import LlamaConfig


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


class Linear(nn.Module):
    """``nn.Linear`` over given tensors (no initialisation pass over weights about to be
    replaced); ``bias`` is None where the checkpoint has none, as in ``nn.Linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = _frozen(weight)
        self.bias = _frozen(bias) if bias is not None else None

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.weight, self.bias)


class Embedding(nn.Module):
    """``nn.Embedding`` over a given table (its ``padding_idx`` changes only gradients)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = _frozen(weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """transformers' ``LlamaRMSNorm``: the variance in float32, the weight applied after the
    cast back to the input's dtype."""

    rms_in_float32 = True
    """In float32 it is ``weight * (x * rsqrt(mean(x^2) + eps))``: what the panels route's row
    kernel computes in its place (``gateway.engine.linear.row_norms``)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = _frozen(weight)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        out: torch.Tensor = self.weight * hidden_states.to(input_dtype)
        return out


class SiLU(nn.Module):
    """transformers' ``SiLUActivation`` (``ACT2FN["silu"]``)."""

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return F.silu(rows)


def default_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """``LlamaRotaryEmbedding.compute_default_rope_parameters``' frequencies (float32)."""
    base = config.rope_parameters["rope_theta"]
    dim = config.head_dim
    inv_freq: torch.Tensor = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq


def llama3_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """``modeling_rope_utils._compute_llama3_parameters``' frequencies (float32), op for op."""
    rope = config.rope_parameters
    base = rope["rope_theta"]
    dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float)
                               / dim))
    factor = rope["factor"]
    low_freq_factor = rope["low_freq_factor"]
    high_freq_factor = rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor
                                                                     - low_freq_factor)
    smoothed_inv_freq = ((1 - smooth_factor) * inv_freq_llama / factor
                         + smooth_factor * inv_freq_llama)
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    out: torch.Tensor = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return out


INV_FREQ = {"default": default_inv_freq, "llama3": llama3_inv_freq}
"""The rotary frequencies by RoPE type (``llama_checkpoint.ROPE_TYPES``); both types scale
cos and sin by 1.0, as transformers' ``attention_factor`` for them is 1.0."""


class RotaryEmbedding(nn.Module):
    """transformers' ``LlamaRotaryEmbedding``: ``rotary(x, position_ids)`` gives cos and sin
    ``[batch, positions, head_dim]`` in ``x``'s dtype."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", INV_FREQ[config.rope_parameters["rope_type"]](config),
                             persistent=False)
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor,
                position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            freqs = (position_ids[..., None].float()
                     * self.inv_freq.to(device=x.device, dtype=torch.float))
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
    """The four projections of a layer's attention (the forward attends by itself), and
    Qwen3's per-head norms of q and k (``Qwen3RMSNorm``, the same ops as ``LlamaRMSNorm``)."""

    def __init__(self, config: LlamaConfig, weights: Mapping[str, torch.Tensor],
                 prefix: str) -> None:
        super().__init__()
        self.q_proj = _linear(weights, prefix + "q_proj")
        self.k_proj = _linear(weights, prefix + "k_proj")
        self.v_proj = _linear(weights, prefix + "v_proj")
        self.o_proj = _linear(weights, prefix + "o_proj")
        if config.qk_norm:
            self.q_norm = RMSNorm(weights[prefix + "q_norm.weight"], config.rms_norm_eps)
            self.k_norm = RMSNorm(weights[prefix + "k_norm.weight"], config.rms_norm_eps)


class MLP(nn.Module):
    """Llama's gated MLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        self.gate_proj = _linear(weights, prefix + "gate_proj")
        self.up_proj = _linear(weights, prefix + "up_proj")
        self.down_proj = _linear(weights, prefix + "down_proj")
        self.act_fn = SiLU()


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, weights: Mapping[str, torch.Tensor],
                 prefix: str) -> None:
        super().__init__()
        self.self_attn = Attention(config, weights, prefix + "self_attn.")
        self.mlp = MLP(weights, prefix + "mlp.")
        self.input_layernorm = RMSNorm(weights[prefix + "input_layernorm.weight"],
                                       config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(
            weights[prefix + "post_attention_layernorm.weight"], config.rms_norm_eps)


class LlamaBody(nn.Module):
    """``LlamaModel``'s modules: embeddings, layers, final norm, rotary embedding."""

    def __init__(self, config: LlamaConfig, weights: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.embed_tokens = Embedding(weights["model.embed_tokens.weight"])
        self.layers = nn.ModuleList(DecoderLayer(config, weights, f"model.layers.{i}.")
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaModules(nn.Module):
    """``LlamaForCausalLM``'s modules over a checkpoint's tensors (module docstring).

    Args:
        config: the checkpoint's config.
        weights: its tensors by state-dict name, already in the run's dtype and device
            (``llama_checkpoint.read_llama_weights``); ``lm_head`` is the embedding table
            when ``config.tie_word_embeddings``, as transformers ties it.
        features: what its layers do (its family's ``DecoderFeatures``), read by the batched
            forward; None where no family runs it batched.
    """

    def __init__(self, config: LlamaConfig, weights: Mapping[str, torch.Tensor],
                 features: DecoderFeatures | None = None) -> None:
        super().__init__()
        self.config = config
        self.features = features
        self.model = LlamaBody(config, weights)
        if config.tie_word_embeddings:
            self.lm_head = Linear(weights["model.embed_tokens.weight"], None)
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = _linear(weights, "lm_head")
        self.model.rotary_emb.to(self.model.embed_tokens.weight.device)
        self.eval()

    def get_input_embeddings(self) -> Embedding:
        return self.model.embed_tokens


def _linear(weights: Mapping[str, torch.Tensor], name: str) -> Linear:
    return Linear(weights[name + ".weight"], weights.get(name + ".bias"))
