"""Each family's checkpoint exercises what its family adds: walked without it (a feature off in
its ``DecoderFeatures``, or the biases its projections carry dropped), the batched forward's
logits are far from transformers', so the conformance suite's agreement is not luck of a
feature that changes nothing on a tiny random model. And features that do not fit a layer's
modules (a norm or projection missing, or one the layer has that they do not apply) are refused
before any step runs: a family that describes less than its layers do is never walked past a
norm."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from gateway.engine.attention.tiled import AttentionItem, SequenceAttention
from gateway.engine.forward.batched import (
    BatchedForward,
    SequenceRows,
    UnsupportedModel,
    projection_weights,
)
from gateway.engine.forward.features import (
    POST_NORMS,
    PRE_NORMS,
    DecoderFeatures,
    ExpertRouting,
    GroupLimitedRouting,
    LayerFeatures,
)
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.row_products import Product, RowProducts
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.families.checkpoints import BUILDERS, VARIANTS
from tests.gateway.engine.parity import engine_forward

PROMPT = [(7 * i + 5) % 400 for i in range(90)]
FAR = 1e-3
"""Ten times the suite's 1e-4: what a skipped feature costs at least (a tiny random model's logits
are small, so a wrong layer moves them little, but far more than two walks of one model differ)."""


def _load(name: str, directory: Path) -> LoadedModel:
    return load_model(str(BUILDERS[name](directory / name)))


def _difference(loaded: LoadedModel, *, features: DecoderFeatures | None = None,
                products: RowProducts | None = None,
                attention: Callable[[SequenceAttention], SequenceAttention] | None = None
                ) -> float:
    """How far the last token's logits of one prefill are from transformers'."""
    chosen = engine_forward(loaded, torch.device("cpu"))
    forward = BatchedForward(loaded.model,
                             attention(chosen.attention) if attention else chosen.attention,
                             products or chosen.products, features or loaded.features)
    tokens = torch.tensor(PROMPT)
    ours = forward.forward([SequenceRows(sequence=KVSequence.alone(loaded.layout, len(PROMPT)),
                                         tokens=tokens, wants_logits=True)])[0]
    assert ours is not None
    with torch.inference_mode():
        theirs = loaded.transformers_model()(tokens.reshape(1, -1)).logits[0, -1].float()
    return float((ours - theirs).abs().max())


def _changed(features: DecoderFeatures,
             change: Callable[[LayerFeatures], LayerFeatures]) -> DecoderFeatures:
    return dataclasses.replace(features, layers=tuple(change(layer) for layer in features.layers))


@pytest.mark.parametrize("family", ["qwen2", "gpt_oss"])
def test_the_projections_biases_are_applied(tmp_path: Path, family: str) -> None:
    """Qwen2's q/k/v biases; gpt-oss's on q/k/v/o, its router and its experts."""
    loaded = _load(family, tmp_path)
    products = engine_forward(loaded, torch.device("cpu")).products
    product = products.product

    def unbiased(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        return product(rows, weight, None)

    dropped: Product = unbiased
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, products=dataclasses.replace(
        products, product_override=dropped)) > FAR


class _WithoutSinks:
    """An attention that drops the items' sinks: what a kernel ignoring them would compute."""

    def __init__(self, inner: SequenceAttention) -> None:
        self.inner = inner
        self.numerics = inner.numerics

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        return self.inner.attend([dataclasses.replace(item, sinks=None) for item in items])


def test_gpt_oss_sinks_join_every_attentions_softmax(tmp_path: Path) -> None:
    loaded = _load("gpt_oss", tmp_path)
    assert loaded.features is not None and loaded.features.has_sinks
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, attention=_WithoutSinks) > FAR


def test_gpt_oss_rotary_frequencies_are_each_repeated_over_both_halves(tmp_path: Path) -> None:
    """Its rotary embedding's tables hold each frequency once: read as they are, they would
    rotate (and YaRN-scale) only each head's first half. Few of a tiny head's frequencies turn
    over 90 positions, so this moves the logits less than ``FAR``: by 5e-4 here, still five
    times what the conformance suite lets pass (1e-4)."""
    loaded = _load("gpt_oss", tmp_path)
    assert loaded.features is not None
    as_given = dataclasses.replace(loaded.features, rotary_frequencies_once=False)
    assert _difference(loaded, features=as_given) > 3e-4


def test_gpt_oss_sliding_windows_are_applied(tmp_path: Path) -> None:
    loaded = _load("gpt_oss", tmp_path)
    assert loaded.features is not None
    assert [layer.window for layer in loaded.features.layers] == [16, None, 16]
    unwindowed = _changed(loaded.features, lambda layer: dataclasses.replace(layer, window=None))
    assert _difference(loaded, features=unwindowed) > FAR


def test_smollm3s_nope_layers_are_not_rotated(tmp_path: Path) -> None:
    loaded = _load("smollm3", tmp_path)
    assert loaded.features is not None
    assert [layer.rotary for layer in loaded.features.layers] == [True, False, True]
    rotating = _changed(loaded.features, lambda layer: dataclasses.replace(layer, rotary=True))
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=rotating) > FAR


def test_glm4s_rotation_turns_neighbouring_pairs_of_half_of_each_head(tmp_path: Path) -> None:
    loaded = _load("glm4", tmp_path)
    assert loaded.features is not None
    halves = _changed(loaded.features,
                      lambda layer: dataclasses.replace(layer, rotary_interleaved=False))
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=halves) > FAR


def test_gemma2s_scores_are_soft_capped(tmp_path: Path) -> None:
    loaded = _load("gemma2", tmp_path)
    assert loaded.features is not None and loaded.features.has_logit_softcap
    uncapped = _changed(loaded.features,
                        lambda layer: dataclasses.replace(layer, logit_softcap=None))
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=uncapped) > FAR


def _deepseek_changed(layer: LayerFeatures, what: str) -> LayerFeatures:
    """A DeepSeek-V3 layer with one of its features that has no module of its own left out."""
    routing = layer.experts
    if what == "the rotary numbers' pairs":
        return dataclasses.replace(layer, rotary_interleaved=False)
    if what == "YaRN's mscale in the scores' scale":
        return dataclasses.replace(layer, attention_scale=(16 + 8) ** -0.5)
    if not isinstance(routing, GroupLimitedRouting):
        return layer
    if what == "the routed experts' scaling":
        return dataclasses.replace(layer, experts=dataclasses.replace(routing, scale=1.0))
    assert what == "the group limit"
    return dataclasses.replace(layer, experts=dataclasses.replace(
        routing, top_groups=routing.groups))


@pytest.mark.parametrize("what", ["the rotary numbers' pairs", "YaRN's mscale in the scores' scale",
                                  "the routed experts' scaling", "the group limit"])
def test_deepseek_v3s_features_are_applied(tmp_path: Path, what: str) -> None:
    loaded = _load("deepseek_v3", tmp_path)
    assert loaded.features is not None
    without = _changed(loaded.features, lambda layer: _deepseek_changed(layer, what))
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=without) > FAR


@pytest.mark.parametrize("checkpoint", ["gemma2", "gemma3-softcapped"])
def test_gemmas_output_logits_are_soft_capped(tmp_path: Path, checkpoint: str) -> None:
    loaded = load_model(str({**BUILDERS, **VARIANTS}[checkpoint](tmp_path / checkpoint)))
    assert loaded.features is not None and loaded.features.final_logit_softcap is not None
    uncapped = dataclasses.replace(loaded.features, final_logit_softcap=None)
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=uncapped) > FAR


@pytest.mark.parametrize(("family", "change", "refusal"), [
    ("qwen3", lambda layer: LayerFeatures(),
     "layer 0 has k_norm, q_norm, which its features do not apply"),
    ("qwen3", lambda layer: LayerFeatures(qk_projection_norm=True),
     r"layer 0 has a q_norm over 16 numbers, not over the projection \(64\)"),
    ("olmo2", lambda layer: LayerFeatures(),
     "layer 0 has no input_layernorm to apply"),
    ("olmo2", lambda layer: dataclasses.replace(layer, qk_projection_norm=False),
     "layer 0 has k_norm, q_norm, which its features do not apply"),
    ("olmo2", lambda layer: dataclasses.replace(layer, qk_projection_norm=False, qk_norm=True),
     r"layer 0 has a q_norm over 64 numbers, not per head \(16\)"),
    ("llama", lambda layer: LayerFeatures(norms=POST_NORMS),
     "layer 0 has no post_feedforward_layernorm to apply"),
    ("phi3", lambda layer: dataclasses.replace(layer, fused_qkv=False),
     "layer 0 has no q_proj and k_proj and v_proj to apply"),
    ("llama", lambda layer: LayerFeatures(fused_gate_up=True),
     "layer 0 has no gate_up_proj and activation_fn to apply"),
    ("glm4", lambda layer: dataclasses.replace(layer, norms=PRE_NORMS),
     "layer 0 has post_mlp_layernorm, post_self_attn_layernorm, which its features do not "
     "apply"),
    ("gemma3", lambda layer: dataclasses.replace(layer, norms=PRE_NORMS),
     "layer 0 has post_feedforward_layernorm, pre_feedforward_layernorm, which its features "
     "do not apply"),
    ("gpt_oss", lambda layer: dataclasses.replace(layer, sinks=False),
     "layer 0 has attention sinks, which its features do not apply"),
    ("llama", lambda layer: LayerFeatures(sinks=True), "layer 0 has no attention sinks to apply"),
    ("gpt_oss", lambda layer: dataclasses.replace(
        layer, experts=ExpertRouting(top_k=2, normalize=True)), "layer 0 has no gate to apply"),
    ("gemma2", lambda layer: dataclasses.replace(layer, qk_norm=True),
     "layer 0 has no q_norm and k_norm to apply"),
], ids=["qwen3-as-llama", "qwen3-qk-over-projection", "olmo2-as-llama", "olmo2-without-qk",
        "olmo2-qk-per-head", "llama-post-norms", "phi3-unfused", "llama-fused",
        "glm4-pre-norms-only", "gemma3-pre-norms-only", "gpt-oss-without-sinks",
        "llama-with-sinks", "gpt-oss-as-qwen3-moe", "gemma2-as-gemma3"])
def test_features_that_do_not_fit_a_layers_modules_are_refused_before_a_step(
        tmp_path: Path, family: str, change: Callable[[LayerFeatures], LayerFeatures],
        refusal: str) -> None:
    """Every norm and projection a layer has is one its features apply, and the other way
    round: a family that describes less than its layers do is refused, never walked past a
    norm."""
    loaded = _load(family, tmp_path)
    assert loaded.features is not None
    chosen = engine_forward(loaded, torch.device("cpu"))
    with pytest.raises(UnsupportedModel, match=f"^{refusal} \\({family} layers\\)$"):
        BatchedForward(loaded.model, chosen.attention, chosen.products,
                       _changed(loaded.features, change))


def test_the_products_padding_is_searched_over_fused_projections(tmp_path: Path) -> None:
    loaded = _load("phi3", tmp_path)
    layer = loaded.model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    assert [w.data_ptr() for w in projection_weights(loaded.model)] == [
        w.data_ptr() for w in (attention.qkv_proj.weight, attention.o_proj.weight,
                               mlp.gate_up_proj.weight, mlp.down_proj.weight)]


def test_the_products_padding_is_searched_over_gpt_oss_experts_as_they_multiply(
        tmp_path: Path) -> None:
    """gpt-oss stores its experts [in, out]: the search pads the [out, in] views its products
    take, beside the router's weight."""
    loaded = _load("gpt_oss", tmp_path)
    mlp = loaded.model.model.layers[0].mlp
    weights = projection_weights(loaded.model)
    expected = (mlp.router.weight, mlp.experts.gate_up_proj[0].T, mlp.experts.down_proj[0].T)
    assert [(tuple(w.shape), w.stride()) for w in weights[-3:]] == [
        (tuple(w.shape), w.stride()) for w in expected]
    assert [w.data_ptr() for w in weights[-3:]] == [w.data_ptr() for w in expected]


class _KindsAlike(torch.nn.Module):
    """A rotary embedding that takes a layer kind (as Gemma 3's does) and rotates every kind as
    ``inner`` does: two kinds of rotation, each as narrow as a partial rotation's tables."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, kind: str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        del kind
        out: tuple[torch.Tensor, torch.Tensor] = self.inner(x, position_ids)
        return out


@pytest.mark.parametrize("family", ["glm4", "phi3-partial"])
def test_rotation_kinds_side_by_side_are_each_sliced_at_their_own_width(
        tmp_path: Path, family: str) -> None:
    """Layers of two rotation kinds (Gemma 3's tables side by side) whose tables are narrower
    than a head (a partial rotation): each layer reads its own kind's columns, so the walk is
    transformers' as with one kind."""
    loaded = load_model(str({**BUILDERS, **VARIANTS}[family](tmp_path / family)))
    assert loaded.features is not None
    loaded.model.model.rotary_emb = _KindsAlike(loaded.model.model.rotary_emb)
    two_kinds = dataclasses.replace(loaded.features, layers=tuple(
        dataclasses.replace(layer, rope=None if index % 2 else "other")
        for index, layer in enumerate(loaded.features.layers)))
    assert len(two_kinds.rope_kinds) == 2
    assert _difference(loaded, features=two_kinds) <= 1e-4


def test_qwen3_nexts_shared_expert_is_added_to_the_routed_experts(tmp_path: Path) -> None:
    loaded = _load("qwen3_next", tmp_path)
    assert loaded.features is not None

    def without_shared(layer: LayerFeatures) -> LayerFeatures:
        if not isinstance(layer.experts, ExpertRouting):
            return layer
        return dataclasses.replace(layer, experts=dataclasses.replace(layer.experts,
                                                                      shared_expert=False))

    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=_changed(loaded.features, without_shared)) > FAR


def _without_in_experts(features: DecoderFeatures, what: str) -> DecoderFeatures:
    def without(layer: LayerFeatures) -> LayerFeatures:
        assert isinstance(layer.experts, ExpertRouting)
        return dataclasses.replace(layer, experts=dataclasses.replace(layer.experts,
                                                                      **{what: False}))
    return _changed(features, without)


@pytest.mark.parametrize("what", ["embedding_multiplier", "logits_divisor", "residual_multiplier",
                                  "shared_mlp"])
def test_granite_hybrids_multipliers_and_shared_mlp_are_applied(tmp_path: Path,
                                                                what: str) -> None:
    loaded = _load("granite_hybrid", tmp_path)
    features = loaded.features
    assert features is not None
    if what == "embedding_multiplier":
        changed = dataclasses.replace(features, embedding_multiplier=None)
    elif what == "logits_divisor":
        changed = dataclasses.replace(features, logits_divisor=None)
    elif what == "residual_multiplier":
        changed = _changed(features, lambda layer: dataclasses.replace(layer,
                                                                       residual_multiplier=None))
    else:
        changed = _without_in_experts(features, what)
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=changed) > FAR


def test_granite_hybrids_router_softmaxes_its_top_k_scores_among_themselves(
        tmp_path: Path) -> None:
    """Softmaxed over every expert instead (and not renormalised), a token's two experts weigh
    less than one together."""
    loaded = _load("granite_hybrid", tmp_path)
    assert loaded.features is not None
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=_without_in_experts(loaded.features,
                                                            "softmax_of_top_k")) > FAR


@pytest.mark.parametrize("what", ["attention_in", "attention_out", "mixer_out", "key_multiplier",
                                  "mlp_multipliers", "logits_multiplier"])
def test_falcon_h1s_multipliers_are_applied(tmp_path: Path, what: str) -> None:
    """Each of Falcon-H1's multipliers, set to one (or left out), moves the logits far."""
    loaded = _load("falcon_h1", tmp_path)
    features = loaded.features
    assert features is not None
    if what == "logits_multiplier":
        changed = dataclasses.replace(features, logits_multiplier=None)
    elif what == "key_multiplier":
        changed = _changed(features, lambda layer: dataclasses.replace(layer, key_multiplier=None))
    elif what == "mlp_multipliers":
        changed = _changed(features, lambda layer: dataclasses.replace(layer,
                                                                       mlp_multipliers=None))
    else:
        def unscaled(layer: LayerFeatures) -> LayerFeatures:
            assert layer.parallel is not None
            return dataclasses.replace(layer, parallel=dataclasses.replace(layer.parallel,
                                                                           **{what: 1.0}))
        changed = _changed(features, unscaled)
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=changed) > FAR
