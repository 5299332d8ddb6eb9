"""What each family reads of a config (``families.describe``): the features of every layer, or
in one line why the batched forward cannot run it -- checked on transformers' own config
classes, whose defaults are the ones a user's checkpoint gets."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    Glm4Config,
    GPT2Config,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from gateway.engine.forward.features import (
    GEMMA3_NORMS,
    GLM4_NORMS,
    POST_NORMS,
    ClampedSwigluRouting,
    DecoderFeatures,
    LayerFeatures,
)
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
    assert features.layers == (LayerFeatures(qk_projection_norm=True, norms=POST_NORMS),) * 4


def test_phi3_fuses_its_projections_and_windows_every_layer_where_its_config_sets_one() -> None:
    features = describe(Phi3Config(**SHAPE, sliding_window=2047,
                                   architectures=["Phi3ForCausalLM"]))
    assert isinstance(features, DecoderFeatures), features
    assert features.layers == (LayerFeatures(window=2047, fused_qkv=True,
                                             fused_gate_up=True),) * 4


def test_phi3_rotating_part_of_each_head_is_its_own_llama_rotating_part_is_refused() -> None:
    partial = {**SHAPE, "partial_rotary_factor": 0.5}
    assert isinstance(describe(Phi3Config(**partial, architectures=["Phi3ForCausalLM"])),
                      DecoderFeatures)
    assert describe(LlamaConfig(**partial, architectures=["LlamaForCausalLM"])) == (
        "llama: partial rotary embeddings (partial_rotary_factor 0.5)")


@pytest.mark.parametrize(("config", "family", "kind"), [
    (Phi3Config(**SHAPE, max_position_embeddings=131072, original_max_position_embeddings=4096,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
                architectures=["Phi3ForCausalLM"]), "phi3", "longrope"),
    (LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                           "rope_theta": 10000.0},
                 architectures=["LlamaForCausalLM"]), "llama", "dynamic"),
    (Gemma3TextConfig(**SHAPE, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
        architectures=["Gemma3ForCausalLM"]), "gemma3", "dynamic"),
], ids=["phi3-longrope", "llama-dynamic", "gemma3-dynamic-global-layers"])
def test_a_rotary_embedding_that_changes_with_the_length_is_refused(config: Any, family: str,
                                                                    kind: str) -> None:
    assert describe(config) == (
        f"{family}: a rotary embedding whose frequencies change with the sequence's length "
        f"(rope_type {kind}): a position's keys would depend on how long the sequence grew, "
        "not on the position alone")


def test_glm4_sandwiches_its_sublayers_and_rotates_pairs_of_part_of_each_head() -> None:
    features = describe(Glm4Config(**SHAPE, architectures=["Glm4ForCausalLM"]))
    assert isinstance(features, DecoderFeatures), features
    assert features.layers == (LayerFeatures(norms=GLM4_NORMS, fused_gate_up=True,
                                             rotary_interleaved=True),) * 4


def test_mistral_windows_every_layer_where_its_config_sets_a_window() -> None:
    config = MistralConfig(**SHAPE, sliding_window=4096, architectures=["MistralForCausalLM"])
    assert _windows(config) == (4096,) * 4
    unwindowed = MistralConfig(**SHAPE, sliding_window=None,
                               architectures=["MistralForCausalLM"])
    assert _windows(unwindowed) == (None,) * 4


def test_gpt_oss_has_sinks_and_its_experts_on_every_layer_and_windows_every_other() -> None:
    """transformers' defaults: sliding and full layers alternating, YaRN positions (not
    refused: their frequencies do not change with the length), swiglu_alpha 1.702 and
    swiglu_limit 7.0, its rotary tables each frequency once."""
    config = GptOssConfig(**SHAPE, sliding_window=128, num_local_experts=4,
                          num_experts_per_tok=2, architectures=["GptOssForCausalLM"])
    features = describe(config)
    assert isinstance(features, DecoderFeatures), features
    routing = ClampedSwigluRouting(top_k=2, alpha=1.702, limit=7.0)
    assert features.rotary_frequencies_once
    assert features.layers == tuple(LayerFeatures(window=window, experts=routing, sinks=True)
                                    for window in (128, None, 128, None))


def test_gemma2_windows_every_other_layer_scales_and_soft_caps_its_scores_and_logits() -> None:
    """transformers' defaults: local layers first and every other one, a window of 4,096, the
    scores scaled by ``query_pre_attn_scalar`` (256) and capped at 50, the logits at 30."""
    features = describe(Gemma2Config(**SHAPE, architectures=["Gemma2ForCausalLM"]))
    assert isinstance(features, DecoderFeatures), features
    assert features.layers == tuple(
        LayerFeatures(window=window, attention_scale=256 ** -0.5, norms=GEMMA3_NORMS,
                      logit_softcap=50.0)
        for window in (4096, None, 4096, None))
    assert features.final_logit_softcap == 30.0


def test_gemma2_without_soft_caps_caps_nothing() -> None:
    config = Gemma2Config(**SHAPE, attn_logit_softcapping=None, final_logit_softcapping=None,
                          architectures=["Gemma2ForCausalLM"])
    features = describe(config)
    assert isinstance(features, DecoderFeatures), features
    assert not features.has_logit_softcap and features.final_logit_softcap is None


def test_gemma3_with_soft_caps_set_caps_its_logits_not_its_scores_as_transformers_does() -> None:
    """transformers' Gemma 3 attention never reads ``attn_logit_softcapping``; its model caps
    the output logits with ``final_logit_softcapping``."""
    config = Gemma3TextConfig(**SHAPE, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0,
                              architectures=["Gemma3ForCausalLM"])
    features = describe(config)
    assert isinstance(features, DecoderFeatures), features
    assert not features.has_logit_softcap
    assert features.final_logit_softcap == 30.0


@pytest.mark.parametrize("config", [
    Gemma2Config(**SHAPE, use_bidirectional_attention=True,
                 architectures=["Gemma2ForCausalLM"]),
    Gemma3TextConfig(**SHAPE, use_bidirectional_attention=True,
                     architectures=["Gemma3ForCausalLM"]),
], ids=["gemma2", "gemma3"])
def test_gemmas_bidirectional_attention_is_refused(config: Any) -> None:
    problem = describe(config)
    assert isinstance(problem, str)
    assert problem.endswith(": bidirectional attention (use_bidirectional_attention)")


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
    with pytest.raises(ValueError, match="a layer that does not rotate has no rotation form"):
        LayerFeatures(rotary=False, rotary_interleaved=True)
