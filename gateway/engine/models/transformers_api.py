"""Everything that touches ``transformers``: the one module that imports it.

transformers' APIs (cache objects above all) change shape between releases, so all of it lives
here. Checked against transformers 5.23, where a cache is a list of layer objects.

NOTE: only ``gateway.engine.models.loading`` imports this module, and only inside the functions that
need it: importing transformers costs about 2 s (it pulls in ``torch.distributed.tensor``,
sympy and dynamo), and a start whose model is read without it (a Llama checkpoint on the
batched route: ``gateway.engine.models.llama_modules``) must not pay that. What needs it:

- converting a GGUF (the first start with the bundled model);
- a checkpoint that ``gateway.engine.models.llama_checkpoint`` or ``gateway.core.file_tokenizer``
does
  not read exactly (another architecture, a model-specific tokenizer class...);
- the serial exact route and the cold references (``compute_block_kv``), which run
  transformers' own model -- built over the very tensors the batched forward walks
  (``model_over``), so the two routes never hold two copies of the weights.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from gateway.engine.kv.latent import joined_latent, latent_halves
from gateway.engine.kv.sequence import KVSequence


def load_pretrained(directory: Path, *, gguf_file: str | None, dtype: torch.dtype,
                    device: torch.device | str) -> tuple[Any, Any]:
    """transformers' model (eval mode, on ``device``) and tokenizer of a checkpoint.

    Raises:
        OSError, ValueError: transformers cannot load it.
    """
    extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(directory, **extra)
    model: Any = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **extra)
    model.to(device)
    model.eval()
    return model, tokenizer


def load_tokenizer(directory: Path) -> Any:
    """transformers' tokenizer of a checkpoint directory.

    Raises:
        OSError, ValueError: transformers cannot load it.
    """
    return AutoTokenizer.from_pretrained(directory)


def model_over(modules: torch.nn.Module, directory: Path) -> Any:
    """transformers' ``LlamaForCausalLM`` for the checkpoint in ``directory``, its parameters
    the very tensors of ``modules`` (a ``gateway.engine.models.llama_modules.LlamaModules`` with the
    same state-dict names), in eval mode.

    Built on the meta device and then given ``modules``' parameters, so nothing is read or
    allocated twice; only the rotary frequencies (buffers, not in any state dict) are computed
    again, by transformers' own rotary embedding, and moved beside the weights.
    """
    config = AutoConfig.from_pretrained(directory)
    weight = next(modules.parameters())
    auto: Any = AutoModelForCausalLM  # its from_config is unannotated
    with torch.device("meta"):
        model: Any = auto.from_config(config, dtype=weight.dtype)
    model.load_state_dict(modules.state_dict(keep_vars=True), strict=True, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(weight.device)
    model.eval()
    return model


def write_converted(directory: Path, gguf_file: str, dtype: torch.dtype, out: Path) -> None:
    """Dequantise ``directory/gguf_file`` and write it to ``out`` (created) as a plain
    checkpoint: config, ``model.safetensors`` (no pickle) and tokenizer files."""
    from safetensors.torch import save_file

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not getattr(config, "architectures", None):
        # A GGUF's config names no architecture; other loaders of this checkpoint (`transformers
        # serve`, the reference of `kvgate bench load`) need one to pick the model class.
        config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    tokenizer.save_pretrained(out)
    (out / "kvgate-source.json").write_text(json.dumps({"gguf": str(directory / gguf_file)}))


def compute_block_kv(model: Any, ids: torch.Tensor, block_tokens: int, *, latent: bool = False
                     ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """``gateway.engine.models.loading.compute_block_kv`` on transformers' ``model`` (``ids``
    ``[1, n]`` on its device); ``latent``: a latent-attention model, whose cache layers hold the
    latent and the rotary key, laid over the K and V halves as the pages hold them."""
    num_blocks = int(ids.shape[1]) // block_tokens
    cache: Any = DynamicCache(config=model.config)
    out: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
    with torch.inference_mode():
        for i in range(num_blocks):
            span = slice(i * block_tokens, (i + 1) * block_tokens)
            model(input_ids=ids[:, span], past_key_values=cache, use_cache=True)
            if latent:
                halves = [latent_halves(torch.cat([layer.keys[0, 0, span],
                                                   layer.values[0, 0, span]], dim=-1))
                          for layer in cache.layers]  # [tokens, 1, half] each
                keys = tuple(k.transpose(0, 1).contiguous() for k, _ in halves)
                values = tuple(v.transpose(0, 1).contiguous() for _, v in halves)
            else:
                keys = tuple(layer.keys[0, :, span].clone() for layer in cache.layers)
                values = tuple(layer.values[0, :, span].clone() for layer in cache.layers)
            out.append((keys, values))
    return out


def forward_logits(model: Any, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Run one chunk ``[1, n]`` (on the model's device) through ``model`` on top of ``cache``;
    the last position's logits, float32."""
    with torch.inference_mode():
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
    logits: torch.Tensor = out.logits[0, -1].float()
    return logits


def make_sequence_cache(sequence: KVSequence, latent_rank: int | None = None) -> Cache:
    """A transformers cache object whose layers read and write ``sequence``'s pages.

    transformers' ``DynamicCache`` concatenates every layer's K/V on every step, re-copying the
    whole context per token; these layers write each step's K/V into the request's pages and
    hand attention the pages gathered. Verified bit-identical to
    ``DynamicCache`` for the same chunks (tests/gateway/engine/test_engine.py).
    """
    if latent_rank is not None:
        return Cache(layers=[LatentSequenceLayer(sequence, i, latent_rank)
                             for i in range(sequence.layout.num_layers)])
    return Cache(layers=[SequenceLayer(sequence, i) for i in range(sequence.layout.num_layers)])


class SequenceLayer(DynamicLayer):
    """One layer of ``make_sequence_cache``: its K/V live in a ``KVSequence``."""

    def __init__(self, sequence: KVSequence, layer: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._sequence = sequence
        self._layer = layer
        self._length = sequence.length
        self.dtype = sequence.layout.dtype
        self.device = sequence.pool.device
        self.is_initialized = True
        self._refresh()

    def _refresh(self) -> None:
        self.keys = self._sequence.key_buffer(self._layer)[None, :, : self._length]
        self.values = self._sequence.value_buffer(self._layer)[None, :, : self._length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(key_states.shape[-2])
        end = self._length + n
        # Written through the sequence (into its pages), read back gathered: the buffers
        # ``key_buffer`` returns are copies.
        self._sequence.write(self._layer, key_states[0], value_states[0])
        self._length = end
        self._refresh()
        keys = self._sequence.key_buffer(self._layer)[None, :, :end]
        values = self._sequence.value_buffer(self._layer)[None, :, :end]
        return keys, values

    def get_seq_length(self) -> int:
        return self._length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def get_max_length(self) -> int:
        return self._sequence.capacity


class LatentSequenceLayer(SequenceLayer):  # type: ignore[no-untyped-call]
    """A latent-attention model's layer of ``make_sequence_cache``: transformers hands it each
    token's latent (as keys, ``[1, 1, n, rank]``) and rotary key (as values), which the pages
    hold side by side over their K and V halves (``gateway.engine.kv.latent``)."""

    def __init__(self, sequence: KVSequence, layer: int, rank: int) -> None:
        self._rank = rank
        super().__init__(sequence, layer)

    def _joined(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        latent = joined_latent(self._sequence.key_buffer(self._layer),
                               self._sequence.value_buffer(self._layer))[None, :, :end]
        return latent[..., :self._rank], latent[..., self._rank:]

    def _refresh(self) -> None:
        self.keys, self.values = self._joined(self._length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = int(key_states.shape[-2])
        key_half, value_half = latent_halves(torch.cat([key_states[0, 0], value_states[0, 0]],
                                                       dim=-1))
        self._sequence.write(self._layer, key_half.transpose(0, 1), value_half.transpose(0, 1))
        self._length += n
        keys, values = self._joined(self._length)
        self.keys, self.values = keys, values
        return keys, values
