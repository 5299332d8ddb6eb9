"""What kvgate cannot serve exactly is refused at start-up in one line, with exit status 2 and no
traceback, before any tier is opened (issue 43, item 6): layers with a recurrent state, quantized
weights, layer kinds nothing here reads, multi-head latent attention outside DeepSeek-V3. An
all-attention architecture no family runs batched is not refused: it runs the serial route."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BambaConfig

from gateway.cli.common import EXIT_USAGE
from gateway.engine.models.loading import UnservableModel, load_model
from gateway.engine.models.refusals import config_problem
from tests.tiny_llama import save_tiny_llama
from tests.tokenizer_fixture import make_hf_tokenizer


def test_layers_with_a_recurrent_state_are_named_with_their_indices() -> None:
    kinds = ["linear_attention", "linear_attention", "full_attention", "conv"]
    assert config_problem({"layer_types": kinds}) == (
        "3 of its 4 layers keep a recurrent state (conv, linear_attention; layers 0-1, 3) that "
        "the cache cannot hold exactly yet: only attention layers' K/V are cached")


def test_a_recurrent_model_type_without_layer_types_is_refused() -> None:
    assert "(mamba2) keep a recurrent state" in str(config_problem({"model_type": "mamba2"}))


def test_quantized_weights_are_refused_naming_the_method() -> None:
    problem = config_problem({"quantization_config": {"quant_method": "awq"}})
    assert problem is not None and problem.startswith("its weights are quantized (awq)")


def test_a_layer_kind_nothing_reads_is_named() -> None:
    problem = config_problem({"layer_types": ["full_attention", "indexed_attention"]})
    assert problem == "it has layers of kinds nothing in kvgate reads (indexed_attention)"


def test_latent_attention_outside_the_latent_architectures_is_refused() -> None:
    problem = config_problem({"kv_lora_rank": 512, "architectures": ["DeepseekV2ForCausalLM"]})
    assert problem is not None and "multi-head latent attention" in problem
    assert "DeepseekV2ForCausalLM" in problem and "DeepseekV3ForCausalLM only" in problem


def test_deepseek_v3s_latent_attention_is_not_refused() -> None:
    assert config_problem({"kv_lora_rank": 512, "qk_rope_head_dim": 64, "head_dim": 64,
                           "v_head_dim": 128, "architectures": ["DeepseekV3ForCausalLM"]}) is None


@pytest.mark.parametrize("config", [
    {"model_type": "gpt2"},
    {"layer_types": ["sliding_attention", "full_attention"], "model_type": "gemma3_text"},
    {"model_type": "lfm2", "layer_types": ["full_attention"] * 2},
])
def test_all_attention_layers_are_not_refused(config: dict[str, object]) -> None:
    assert config_problem(config) is None


def _save_bamba(directory: Path) -> Path:
    """A Bamba (Mamba-2 layers around one attention layer): a hybrid whose family is not built,
    its config listing no ``layer_types``."""
    tokenizer = make_hf_tokenizer()
    config = BambaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_expand=1)
    torch.manual_seed(0)
    auto: object = AutoModelForCausalLM
    auto.from_config(config).save_pretrained(directory)  # type: ignore[attr-defined]
    tokenizer.save_pretrained(directory)
    return directory


def _with_config(directory: Path, **fields: object) -> Path:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return directory


def test_loading_a_hybrid_raises_before_reading_weights(tmp_path: Path) -> None:
    directory = _save_bamba(tmp_path / "hybrid")
    for weights in directory.glob("*.safetensors"):
        weights.write_bytes(b"not read")
    with pytest.raises(UnservableModel, match="keep a recurrent state"):
        load_model(str(directory))


@pytest.mark.parametrize("kind", ["hybrid", "quantized", "unknown-layer"])
def test_serve_refuses_in_one_line_with_exit_2(tmp_path: Path, kind: str) -> None:
    if kind == "hybrid":
        directory = _save_bamba(tmp_path / kind)
        expected = "its layers (bamba) keep a recurrent state"
    elif kind == "quantized":
        directory = _with_config(save_tiny_llama(tmp_path / kind),
                                 quantization_config={"quant_method": "gptq", "bits": 4})
        expected = "its weights are quantized (gptq)"
    else:
        directory = _with_config(save_tiny_llama(tmp_path / kind),
                                 layer_types=["full_attention", "compressed_sparse_attention"])
        expected = "layers of kinds nothing in kvgate reads (compressed_sparse_attention)"
    kvgate = Path(sys.executable).parent / "kvgate"
    result = subprocess.run(
        [str(kvgate), "serve", "--model", str(directory), "--data-dir", str(tmp_path / "data"),
         "--port", "0", "--http-port", "0", "--log-level", "WARNING"],
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == EXIT_USAGE
    assert "Traceback" not in result.stderr
    refusals = [line for line in result.stderr.splitlines() if line.startswith("kvgate serve:")]
    assert len(refusals) == 1
    assert refusals[0].startswith(f"kvgate serve: cannot serve {directory} exactly: ")
    assert expected in refusals[0]
    assert not (tmp_path / "data" / "kv").exists()  # the disk tier was never opened
