"""A checkpoint of Llama's layer read without transformers: its ``config.json`` and its
safetensors weights, for Llama and the dialects that only add to its layer (Qwen3's per-head
q/k norms and windows: ``gateway.engine.models.checkpoint_dialects``).

Why: importing transformers costs about 2 s of every start (it pulls in
``torch.distributed.tensor``, sympy and dynamo), while the batched forward needs only a
handful of numbers from the config and the tensors themselves; and weights read into memory of
their own can be laid out for the products in place, where transformers' stay mapped from the
file. So such a checkpoint is read here, field by field with the defaults of its transformers
5.23 config class and their RoPE standardisation
(``RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`` and ``standardize_rope_params``),
and its weights straight from the safetensors files.

Anything this reading does not cover exactly -- another model type, an activation other than
SiLU, a RoPE type other than ``default`` and ``llama3``, quantised or pickled weights, tensor
names other than the ``*ForCausalLM``'s -- raises ``UnsupportedCheckpoint`` saying what, and
``gateway.engine.models.loading`` loads that checkpoint through transformers instead. Covering less
and falling back is the point: a reading that differs from transformers' in one field would
compute other K/V under the same block namespace.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gateway.engine.models.checkpoint_dialects import DIALECTS, LAYER_KINDS, CheckpointDialect
from gateway.engine.models.safetensors_file import read_tensors

ROPE_TYPES = ("default", "llama3")
"""The RoPE types read here (``gateway.engine.models.llama_modules`` computes their frequencies)."""

_DEFAULT_THETA = 10_000.0
"""``RotaryEmbeddingConfigMixin.default_theta``: the base when a config names none."""
_ROPE_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")
_IGNORED_TENSORS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
"""Old checkpoints saved the rotary frequencies; transformers recomputes and ignores them."""
_WEIGHTS = "model.safetensors"
_WEIGHTS_INDEX = "model.safetensors.index.json"


class UnsupportedCheckpoint(ValueError):
    """The checkpoint is not one this module reads exactly; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """What ``gateway.engine.forward.batched`` and the engine read of the config of a
    checkpoint of Llama's layer, with the values transformers 5.23 gives them (its attribute
    names, so both loads look alike).

    Attributes:
        rope_parameters: standardised as transformers does: ``rope_type`` and ``rope_theta``
            always present, ``original_max_position_embeddings`` for ``llama3``.
        sliding_window: the window of the "sliding_attention" layers; None where it has none.
        layer_types: each layer's attention kind (Qwen3's); None where the config class has
            no such field (Llama).
        qk_norm: each layer normalises q and k per head (its dialect's ``qk_norm``).
    """

    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False

    @property
    def rope_scaling(self) -> dict[str, Any]:
        """transformers 5's alias of ``rope_parameters`` (``architecture_problem`` reads it)."""
        return self.rope_parameters


def read_llama_config(directory: Path) -> LlamaConfig:
    """The config of the checkpoint in ``directory``, read as transformers 5.23 reads it.

    Raises:
        UnsupportedCheckpoint: it is not a config of a dialect this module reads exactly.
    """
    path = directory / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedCheckpoint(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise UnsupportedCheckpoint(f"{path} is not a JSON object")
    dialect = DIALECTS.get(raw.get("model_type"))  # type: ignore[arg-type]
    if dialect is None:
        raise UnsupportedCheckpoint(f"model_type {raw.get('model_type')!r} is not one of "
                                    f"{sorted(DIALECTS)}")
    if raw.get("quantization_config") is not None:
        raise UnsupportedCheckpoint("the weights are quantised (quantization_config)")
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"hidden_act {raw.get('hidden_act')!r} is not 'silu'")

    def read(name: str) -> Any:
        return raw.get(name, dialect.defaults.get(name))

    hidden_size = int(read("hidden_size"))
    num_heads = int(read("num_attention_heads"))
    num_layers = int(read("num_hidden_layers"))
    max_positions = int(read("max_position_embeddings"))
    sliding_window, layer_types = _windows(raw, dialect, num_layers)
    return LlamaConfig(
        architectures=tuple(raw.get("architectures") or (dialect.architecture,)),
        model_type=dialect.model_type,
        vocab_size=int(read("vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(read("intermediate_size")),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(read("num_key_value_heads") or num_heads),
        head_dim=_head_dim(raw, dialect, hidden_size, num_heads),
        hidden_act="silu",
        max_position_embeddings=max_positions,
        rms_norm_eps=read("rms_norm_eps"),
        rope_parameters=_rope_parameters(raw, max_positions),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)) if dialect.reads_mlp_bias else False,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=read("bos_token_id"),
        eos_token_id=read("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        qk_norm=dialect.qk_norm,
    )


def _head_dim(raw: dict[str, Any], dialect: CheckpointDialect, hidden_size: int,
              num_heads: int) -> int:
    if dialect.head_dim_from_width:
        return int(raw.get("head_dim") or hidden_size // num_heads)
    head_dim = raw.get("head_dim", dialect.defaults.get("head_dim"))
    if head_dim is None:
        raise UnsupportedCheckpoint("head_dim is null")
    return int(head_dim)


def _windows(raw: dict[str, Any], dialect: CheckpointDialect,
             num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """``sliding_window`` and ``layer_types`` as ``Qwen3Config.__post_init__`` leaves them (the
    window kept only with ``use_sliding_window``, the kinds filled in from
    ``max_window_layers`` where the config lists none)."""
    if not dialect.windows:
        return None, None
    window = raw.get("sliding_window", dialect.defaults.get("sliding_window"))
    window = window if raw.get("use_sliding_window", False) else None
    kinds = raw.get("layer_types")
    if kinds is None:
        first_windowed = int(raw.get("max_window_layers", dialect.defaults["max_window_layers"]))
        kinds = ["sliding_attention" if window is not None and i >= first_windowed
                 else "full_attention" for i in range(num_layers)]
    if (not isinstance(kinds, list) or len(kinds) != num_layers
            or any(kind not in LAYER_KINDS for kind in kinds)):
        raise UnsupportedCheckpoint(f"layer_types {kinds!r} is not one of {LAYER_KINDS} "
                                    "per layer")
    return (None if window is None else int(window)), tuple(kinds)


def _rope_parameters(raw: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """``rope_parameters`` as ``convert_rope_params_to_dict`` then ``standardize_rope_params``
    leave them (an old ``rope_scaling`` taking precedence, ``rope_theta`` moved in)."""
    found = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(found, dict) or any(isinstance(v, dict) for v in found.values()):
        raise UnsupportedCheckpoint(f"rope parameters {found!r} are not one flat mapping")
    rope = dict(found)
    rope.setdefault("rope_theta", raw.get("rope_theta", _DEFAULT_THETA))
    if "partial_rotary_factor" in raw:
        rope.setdefault("partial_rotary_factor", raw["partial_rotary_factor"])
    rope.setdefault("rope_type", rope.get("type", "default"))
    if rope["rope_type"] in _ROPE_WITH_ORIGINAL_LENGTH:
        if "original_max_position_embeddings" in raw:
            rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", max_positions)
    if rope["rope_type"] not in ROPE_TYPES:
        raise UnsupportedCheckpoint(f"rope type {rope['rope_type']!r} is not one of {ROPE_TYPES}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedCheckpoint("a partial rotary factor is not read here")
    return rope


def expected_tensor_names(config: LlamaConfig) -> set[str]:
    """The tensor names of the ``*ForCausalLM``'s state (no ``lm_head`` when it is tied)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    projections = [("self_attn", p, config.attention_bias) for p in ("q", "k", "v", "o")]
    projections += [("mlp", p, config.mlp_bias) for p in ("gate", "up", "down")]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        names |= {prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"}
        if config.qk_norm:
            names |= {prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"}
        for block, name, has_bias in projections:
            names.add(f"{prefix}{block}.{name}_proj.weight")
            if has_bias:
                names.add(f"{prefix}{block}.{name}_proj.bias")
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    return names


def read_llama_weights(directory: Path, config: LlamaConfig, *, dtype: torch.dtype,
                       device: torch.device | str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name, cast to ``dtype`` on ``device`` (as
    ``from_pretrained(dtype=...)`` casts them: ``Tensor.to``, round to nearest even).

    Raises:
        UnsupportedCheckpoint: the weights are not safetensors, or their names are not exactly
            ``expected_tensor_names(config)``.
        OSError: a weight file cannot be read (or is not valid safetensors).
    """
    expected = expected_tensor_names(config)
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        try:
            # Read, not mapped: see gateway.engine.models.safetensors_file.
            for name, tensor in read_tensors(path, lambda name: not _IGNORED_TENSORS.search(name)):
                if name not in expected:
                    raise UnsupportedCheckpoint(f"unexpected tensor {name!r} in {path.name}")
                tensors[name] = tensor.to(device=device, dtype=dtype)
        except UnsupportedCheckpoint:
            raise
        except ValueError as exc:  # not valid safetensors
            raise OSError(f"cannot read {path}: {exc}") from exc
    missing = expected - tensors.keys()
    if missing:
        raise UnsupportedCheckpoint(f"{len(missing)} tensor(s) missing, such as "
                                    f"{sorted(missing)[0]!r}")
    return tensors


def _weight_files(directory: Path) -> Iterator[Path]:
    index = directory / _WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UnsupportedCheckpoint(f"cannot read {index}: {exc}") from exc
        for name in names:
            path = directory / name
            if path.parent != directory or not path.is_file():
                raise UnsupportedCheckpoint(f"{index.name} names {name!r}, not a file beside it")
            yield path
    elif (directory / _WEIGHTS).is_file():
        yield directory / _WEIGHTS
    else:
        raise UnsupportedCheckpoint(f"no {_WEIGHTS} (or {_WEIGHTS_INDEX}) in {directory}")
