"""Projections of the same rows joined into one panel product: the same bits as the members
multiplied one by one, over one copy of their weights, and forgotten when the weights go back
plain."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.engine import EngineConfig
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.joined_panels import (
    JOINED_GATE_UP,
    JOINED_QKV,
    join_panels,
    joined,
    unjoin_panels,
)
from gateway.engine.linear.packed_weights import PANEL_LAYOUT, PackedLinear, pack_projections
from gateway.engine.linear.panel_products import Panels, panel_kernel_problem
from gateway.engine.linear.row_padding import RowPadding
from gateway.engine.linear.row_products import RowProducts
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity import route_search
from tests.gateway.engine.test_llama_modules import save_qwen3_tied
from tests.tiny_llama import save_tiny_llama
from tests.tokenizer_fixture import make_hf_tokenizer

PANELS = panel_kernel_problem(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(PANELS is not None, reason=f"no panel kernel here: {PANELS}")
PRODUCTS = RowProducts.of("panels", RowPadding(minimum=1, multiple=1))


def _in_panels(loaded: LoadedModel) -> LoadedModel:
    pack_projections(route_search.packable_projections(loaded.model), PANEL_LAYOUT)
    return loaded


def _run(loaded: LoadedModel) -> tuple[list[torch.Tensor], list[KVSequence]]:
    """Every logit of a chunked prefill of two sequences, then of four decode steps."""
    forward = BatchedForward(loaded.model, TiledAttention(), PRODUCTS, loaded.features)
    sequences = [KVSequence.alone(loaded.layout, 128) for _ in range(2)]
    generator = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, 400, (70,), generator=generator) for _ in sequences]
    logits: list[torch.Tensor] = []
    for start, end in ((0, 29), (29, 66)):
        logits += [x for x in forward.forward([
            SequenceRows(sequence=seq, tokens=ids[start:end], wants_logits=True)
            for seq, ids in zip(sequences, tokens, strict=True)]) if x is not None]
    for at in range(66, 70):
        logits += [x for x in forward.forward([
            SequenceRows(sequence=seq, tokens=ids[at:at + 1], wants_logits=True, is_decode=True)
            for seq, ids in zip(sequences, tokens, strict=True)]) if x is not None]
    return logits, sequences


@pytest.mark.parametrize("save", [save_tiny_llama, save_qwen3_tied],
                         ids=["llama", "qwen3 with biases"])
def test_joined_projections_give_the_bits_of_their_members_one_by_one(
        tmp_path: Path, save: object) -> None:
    loaded = _in_panels(load_model(str(save(tmp_path / "model"))))  # type: ignore[operator]
    apart_logits, apart_kv = _run(loaded)
    assert join_panels(loaded.model) == 2 * loaded.layout.num_layers
    together_logits, together_kv = _run(loaded)
    assert len(apart_logits) == len(together_logits) == 12
    for a, b in zip(apart_logits, together_logits, strict=True):
        assert torch.equal(a, b)
    for apart, together in zip(apart_kv, together_kv, strict=True):
        for layer in range(loaded.layout.num_layers):
            assert torch.equal(apart.keys(layer), together.keys(layer))
            assert torch.equal(apart.values(layer), together.values(layer))


def test_the_members_weights_are_views_of_the_joined_panels(tmp_path: Path) -> None:
    loaded = _in_panels(load_model(str(save_tiny_llama(tmp_path / "model"))))
    join_panels(loaded.model)
    attention = loaded.model.model.layers[0].self_attn
    qkv = joined(attention, JOINED_QKV)
    assert qkv is not None and qkv.widths == (64, 32, 32)
    storage = qkv.weight.data.untyped_storage().data_ptr()
    for name in ("q_proj", "k_proj", "v_proj"):
        weight = getattr(attention, name).weight
        assert isinstance(weight, Panels)
        assert weight.data.untyped_storage().data_ptr() == storage


def test_the_search_joins_a_layers_projections_and_unpacking_forgets_them(
        tmp_path: Path) -> None:
    loaded = load_model(str(save_tiny_llama(tmp_path / "model", tied=True)))
    plain = {name: tensor.clone() for name, tensor in loaded.model.state_dict().items()}
    verdict = route_search.search_route(loaded, EngineConfig().search_settings())
    assert verdict.kernel == "panels"
    route_search.build_forward(loaded, verdict)
    layer = loaded.model.model.layers[1]
    assert joined(layer.self_attn, JOINED_QKV) is not None
    assert joined(layer.mlp, JOINED_GATE_UP) is not None
    route_search.unpack_model(loaded)
    assert joined(layer.self_attn, JOINED_QKV) is None
    assert joined(layer.mlp, JOINED_GATE_UP) is None
    state = loaded.model.state_dict()
    assert all(torch.equal(state[name], plain[name]) for name in plain)


def test_members_not_a_whole_number_of_panels_stay_apart(tmp_path: Path) -> None:
    """k and v of one head of 8 are half a panel: joined, q's last panel would hold zero
    columns between q and k; the MLP's gate and up (96 wide) are joined still."""
    tokenizer = make_hf_tokenizer()
    config = LlamaConfig(vocab_size=512, hidden_size=48, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=1)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = _in_panels(load_model(str(tmp_path)))
    assert join_panels(loaded.model) == 2
    layer = loaded.model.model.layers[0]
    assert joined(layer.self_attn, JOINED_QKV) is None
    assert joined(layer.mlp, JOINED_GATE_UP) is not None
    assert isinstance(layer.self_attn.k_proj, PackedLinear)


def test_unjoining_keeps_the_members_weights(tmp_path: Path) -> None:
    loaded = _in_panels(load_model(str(save_tiny_llama(tmp_path / "model"))))
    join_panels(loaded.model)
    before, _ = _run(loaded)
    unjoin_panels(loaded.model)
    assert joined(loaded.model.model.layers[0].mlp, JOINED_GATE_UP) is None
    after, _ = _run(loaded)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
