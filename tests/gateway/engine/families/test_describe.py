"""What each family reads of a config (``families.describe``): the features of every layer, or
in one line why the batched forward cannot run it -- checked on transformers' own config
classes, whose defaults are the ones a user's checkpoint gets."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import (
    GPT2Config,
    MistralConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.models.families import describe

SHAPE: dict[str, Any] = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16}


def _windows(config: object) -> tuple[int | None, ...]:
    features = describe(config)
    assert isinstance(features, DecoderFeatures), features
    return tuple(layer.window for layer in features.layers)


def test_qwen3_windows_the_layers_from_max_window_layers_on() -> None:
    config = Qwen3Config(**SHAPE, use_sliding_window=True, sliding_window=512,
                         max_window_layers=2, architectures=["Qwen3ForCausalLM"])
    assert _windows(config) == (None, None, 512, 512)


def test_qwen3_without_use_sliding_window_attends_every_key() -> None:
    config = Qwen3Config(**SHAPE, architectures=["Qwen3ForCausalLM"])
    assert _windows(config) == (None,) * 4


def test_qwen2_windows_the_layers_from_max_window_layers_on_with_use_sliding_window() -> None:
    windowed = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=512,
                           max_window_layers=3, architectures=["Qwen2ForCausalLM"])
    assert _windows(windowed) == (None, None, None, 512)
    assert _windows(Qwen2Config(**SHAPE, architectures=["Qwen2ForCausalLM"])) == (None,) * 4


def test_smollm3_rotates_every_layer_but_each_fourth_and_windows_those_with_sliding() -> None:
    eight = {**SHAPE, "num_hidden_layers": 8}
    config = SmolLM3Config(**eight, architectures=["SmolLM3ForCausalLM"])
    features = describe(config)
    assert isinstance(features, DecoderFeatures), features
    assert [layer.rotary for layer in features.layers] == [True, True, True, False] * 2
    windowed = SmolLM3Config(**eight, use_sliding_window=True,
                             sliding_window=512, architectures=["SmolLM3ForCausalLM"])
    assert _windows(windowed) == (None, None, None, 512) * 2


def test_smollm3_without_a_rotary_flag_for_each_layer_is_named() -> None:
    config = SmolLM3Config(**SHAPE, architectures=["SmolLM3ForCausalLM"])
    config.no_rope_layers = [1, 1]
    assert describe(config) == ("smollm3: no_rope_layers ([1, 1]) does not say of each of its "
                                "4 layers whether it rotates")


def test_olmo2_normalises_after_each_sublayer_and_q_and_k_over_the_projection() -> None:
    features = describe(Olmo2Config(**SHAPE, architectures=["Olmo2ForCausalLM"]))
    assert isinstance(features, DecoderFeatures), features
    assert features.layers == (LayerFeatures(qk_projection_norm=True, norms="post"),) * 4


def test_mistral_windows_every_layer_where_its_config_sets_a_window() -> None:
    config = MistralConfig(**SHAPE, sliding_window=4096, architectures=["MistralForCausalLM"])
    assert _windows(config) == (4096,) * 4
    unwindowed = MistralConfig(**SHAPE, sliding_window=None,
                               architectures=["MistralForCausalLM"])
    assert _windows(unwindowed) == (None,) * 4


def test_an_architecture_no_family_answers_for_is_named() -> None:
    problem = describe(GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert isinstance(problem, str)
    assert problem.startswith("architecture ['GPT2LMHeadModel'] is not one of the registered "
                              "families")


def test_a_partial_rotary_embedding_is_refused_by_its_family() -> None:
    config = Qwen3Config(**SHAPE, architectures=["Qwen3ForCausalLM"])
    config.rope_parameters = {**dict(config.rope_parameters or {}),
                              "partial_rotary_factor": 0.5}
    assert describe(config) == "qwen3: partial rotary embeddings (partial_rotary_factor 0.5)"


def test_layer_features_that_contradict_themselves_are_refused() -> None:
    with pytest.raises(ValueError, match="per head or over the projection, not both"):
        LayerFeatures(qk_norm=True, qk_projection_norm=True)
    with pytest.raises(ValueError, match="norms are placed pre or sandwich or post, not 'mid'"):
        LayerFeatures(norms="mid")  # type: ignore[arg-type]
