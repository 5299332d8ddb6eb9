"""The config classes whose checkpoints kvgate reads without transformers: Llama's layer, and
the families that only add to it what the reader can build exactly.

Why a dialect and not a family: a family (``gateway.engine.models.families``) says what the
batched forward walks; a dialect says how one transformers config class fills its fields in
(its defaults differ: Qwen3's ``head_dim`` is 128 whatever the width, Llama's is the width over
the heads) and which extra tensors its layer holds. A checkpoint read here keeps its weights in
memory of its own, so the forward may lay them out for its products in place (the panel kernel);
one loaded through transformers stays mapped from its file.

NOTE: each dialect's defaults are transformers 5.23's (``LlamaConfig``, ``Qwen3Config``),
checked field by field against ``AutoConfig`` in tests/gateway/engine/test_llama_modules.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointDialect:
    """One config class of Llama's layer, as kvgate's reader reads it.

    Attributes:
        model_type: the config's ``model_type``.
        architecture: its ``*ForCausalLM`` class name (the default of ``architectures``).
        defaults: the config class's defaults of the fields read.
        head_dim_from_width: ``head_dim`` defaults to ``hidden_size // num_attention_heads``
            (Llama) rather than to ``defaults["head_dim"]`` (Qwen3).
        qk_norm: each layer normalises q and k per head (``self_attn.q_norm``/``k_norm``).
        reads_mlp_bias: the config's ``mlp_bias`` sets biases on the MLP (Llama); otherwise
            the MLP has none (Qwen3).
        windows: the config's ``use_sliding_window``, ``sliding_window``, ``max_window_layers``
            and ``layer_types`` are read as ``Qwen3Config.__post_init__`` reads them; otherwise
            the model has no windows.
    """

    model_type: str
    architecture: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    head_dim_from_width: bool = True
    qk_norm: bool = False
    reads_mlp_bias: bool = True
    windows: bool = False


_COMMON_DEFAULTS = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                    "rms_norm_eps": 1e-6}

LLAMA = CheckpointDialect(
    model_type="llama", architecture="LlamaForCausalLM",
    defaults=MappingProxyType({**_COMMON_DEFAULTS, "vocab_size": 32000,
                               "intermediate_size": 11008, "max_position_embeddings": 2048,
                               "bos_token_id": 1, "eos_token_id": 2}))

QWEN3 = CheckpointDialect(
    model_type="qwen3", architecture="Qwen3ForCausalLM",
    defaults=MappingProxyType({**_COMMON_DEFAULTS, "vocab_size": 151936,
                               "intermediate_size": 22016, "max_position_embeddings": 32768,
                               "head_dim": 128, "num_key_value_heads": 32,
                               "bos_token_id": None, "eos_token_id": None,
                               "sliding_window": 4096, "max_window_layers": 28}),
    head_dim_from_width=False, qk_norm=True, reads_mlp_bias=False, windows=True)

DIALECTS: Mapping[str, CheckpointDialect] = MappingProxyType(
    {dialect.model_type: dialect for dialect in (LLAMA, QWEN3)})
"""The dialects by ``model_type``: a new one is one record here, under the reader's tests."""

LAYER_KINDS = ("full_attention", "sliding_attention")
"""The ``layer_types`` entries read here; a config listing another kind is left to
transformers."""
