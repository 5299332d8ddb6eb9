"""Each family's checkpoint exercises what its family adds: walked without it (a feature off in
its ``DecoderFeatures``, or the biases its projections carry dropped), the batched forward's
logits are far from transformers', so the conformance suite's agreement is not luck of a
feature that changes nothing on a tiny random model. And a feature whose modules a tree lacks
is refused before any step runs, never skipped."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.forward.features import DecoderFeatures, LayerFeatures
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.row_products import Product, RowProducts
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.families.checkpoints import BUILDERS
from tests.gateway.engine.parity import engine_forward

PROMPT = [(7 * i + 5) % 400 for i in range(90)]
FAR = 1e-3
"""Ten times the suite's 1e-4: what a skipped feature costs at least (a tiny random model's logits
are small, so a wrong layer moves them little, but far more than two walks of one model differ)."""


def _load(name: str, directory: Path) -> LoadedModel:
    return load_model(str(BUILDERS[name](directory / name)))


def _difference(loaded: LoadedModel, *, features: DecoderFeatures | None = None,
                products: RowProducts | None = None) -> float:
    """How far the last token's logits of one prefill are from transformers'."""
    chosen = engine_forward(loaded, torch.device("cpu"))
    forward = BatchedForward(loaded.model, chosen.attention, products or chosen.products,
                             features or loaded.features)
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


def test_qwen2s_biases_are_applied(tmp_path: Path) -> None:
    loaded = _load("qwen2", tmp_path)
    products = engine_forward(loaded, torch.device("cpu")).products
    product = products.product

    def unbiased(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
        return product(rows, weight, None)

    dropped: Product = unbiased
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, products=dataclasses.replace(
        products, product_override=dropped)) > FAR


def test_smollm3s_nope_layers_are_not_rotated(tmp_path: Path) -> None:
    loaded = _load("smollm3", tmp_path)
    assert loaded.features is not None
    assert [layer.rotary for layer in loaded.features.layers] == [True, False, True]
    rotating = _changed(loaded.features, lambda layer: dataclasses.replace(layer, rotary=True))
    assert _difference(loaded) <= 1e-4
    assert _difference(loaded, features=rotating) > FAR
