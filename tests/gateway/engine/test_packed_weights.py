"""Weights packed for their kernel: for oneDNN the same bits as plain ones where the machine's
check says so; for the panel kernel, a tied logits head and its embeddings in one copy; never a
second copy, and the model as it was loaded once the engine stops.

Whether packing keeps a row's bits is the machine's business (its oneDNN, its CPU): tests that
need it take it from ``packing_problem`` on this machine, never assume it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.packed_weights import (
    PackedEmbedding,
    PackedLinear,
    pack_projections,
    packed_count,
    packing_problem,
    plain_weights,
    unpack_projections,
)
from gateway.engine.linear.panel_products import Panels, panel_kernel_problem
from gateway.engine.linear.row_padding import RowPadding
from gateway.engine.linear.row_products import KERNELS, RowProducts, onednn_problem
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity import route_search
from tests.gateway.engine.families.checkpoints import save_qwen2, save_qwen3
from tests.gateway.engine.parity import SECRET
from tests.tiny_llama import save_tiny_llama

ONEDNN = onednn_problem(torch.device("cpu"))
needs_onednn = pytest.mark.skipif(ONEDNN is not None, reason=f"no oneDNN here: {ONEDNN}")
PRODUCTS = RowProducts.of("onednn", RowPadding(minimum=2, multiple=8))
PANELS = panel_kernel_problem(torch.device("cpu"), torch.float32)
needs_panels = pytest.mark.skipif(PANELS is not None, reason=f"no panel kernel here: {PANELS}")


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.detach()


@pytest.fixture
def fresh(tmp_path: Path) -> LoadedModel:
    """A tiny Llama of its own (packing changes the modules in place)."""
    return load_model(str(save_tiny_llama(tmp_path / "model")))


def _plain_problem(loaded: LoadedModel) -> str | None:
    weights = plain_weights(route_search.packable_projections(loaded.model))
    return packing_problem(weights, [2, 3, 8, 9, 64],
                           lambda rows, weight: KERNELS["onednn"](rows, weight, None))


def _logits_and_kv(loaded: LoadedModel) -> tuple[list[torch.Tensor], torch.Tensor]:
    forward = BatchedForward(loaded.model, TiledAttention(), PRODUCTS, loaded.features)
    sequence = KVSequence.alone(loaded.layout, 64)
    tokens = torch.randint(0, 400, (40,), generator=torch.Generator().manual_seed(3))
    logits = [out for out in forward.forward([SequenceRows(
        sequence=sequence, tokens=tokens[:37], wants_logits=True)]) if out is not None]
    for at in range(37, 40):
        logits += [out for out in forward.forward([SequenceRows(
            sequence=sequence, tokens=tokens[at:at + 1], wants_logits=True, is_decode=True)])
            if out is not None]
    return logits, sequence.keys(0).clone()


@needs_onednn
def test_packed_weights_give_the_plain_weights_bits_where_the_check_passes(
        fresh: LoadedModel) -> None:
    if (problem := _plain_problem(fresh)) is not None:
        pytest.skip(f"this machine's oneDNN changes rows when packed: {problem}")
    plain_logits, plain_keys = _logits_and_kv(fresh)
    projections = route_search.packable_projections(fresh.model)
    assert pack_projections(projections) == len(projections) > 0
    packed_logits, packed_keys = _logits_and_kv(fresh)
    assert all(torch.equal(a, b) for a, b in zip(plain_logits, packed_logits, strict=True))
    assert torch.equal(plain_keys, packed_keys)


@needs_onednn
def test_unpacking_restores_the_very_modules_and_their_numbers(fresh: LoadedModel) -> None:
    projections = route_search.packable_projections(fresh.model)
    before = [(where.module, _weight(where.module).clone()) for where in projections]
    pack_projections(projections)
    assert packed_count(projections) == len(projections)
    assert unpack_projections(projections) == len(projections)
    for where, (module, weight) in zip(projections, before, strict=True):
        assert where.module is module
        assert isinstance(module.weight, nn.Parameter)
        assert torch.equal(_weight(module), weight)


@needs_onednn
def test_packing_twice_packs_nothing_more(fresh: LoadedModel) -> None:
    projections = route_search.packable_projections(fresh.model)
    pack_projections(projections)
    assert pack_projections(projections) == 0


@needs_onednn
def test_a_packed_model_reads_back_plain_through_its_state_dict(fresh: LoadedModel) -> None:
    plain = {name: tensor.clone() for name, tensor in fresh.model.state_dict().items()}
    pack_projections(route_search.packable_projections(fresh.model))
    state = fresh.model.state_dict()
    assert state.keys() == plain.keys()
    assert all(torch.equal(state[name], plain[name]) for name in plain)


@needs_onednn
def test_a_packed_module_called_as_a_module_computes_what_it_replaced(
        fresh: LoadedModel) -> None:
    where = route_search.packable_projections(fresh.model)[0]
    rows = torch.randn(2, 5, _weight(where.module).shape[1])
    expected = where.module(rows)
    pack_projections([where])
    assert isinstance(where.module, PackedLinear)
    assert torch.equal(where.module(rows), expected)


def test_a_head_tied_to_the_embeddings_is_never_packed(fresh: LoadedModel) -> None:
    model = fresh.model
    untied = {where.name for where in route_search.packable_projections(model)}
    model.lm_head.weight = model.model.embed_tokens.weight
    tied = {where.name for where in route_search.packable_projections(model)}
    assert "lm_head" in untied and "lm_head" not in tied


@needs_onednn
def test_the_route_search_packs_exactly_where_the_machine_keeps_the_bits(
        fresh: LoadedModel) -> None:
    problem = _plain_problem(fresh)
    verdict = route_search.search_route(fresh,
                                        EngineConfig(linear_kernel="onednn").search_settings())
    if verdict.kernel != "onednn":
        pytest.skip(f"the search chose {verdict.kernel or verdict.name}, not oneDNN, here")
    assert verdict.packed is (problem is None)
    assert ("weights packed" in verdict.reason) is verdict.packed


def test_weights_mapped_from_the_file_are_left_plain(tmp_path: Path) -> None:
    """A family loaded through transformers maps its weights from the checkpoint: a packed
    copy would sit beside each, so nothing is packed."""
    loaded = load_model(str(save_qwen2(tmp_path / "qwen2")))
    assert not loaded.owns_its_weights
    problem = route_search.packing_verdict(loaded, PRODUCTS, EngineConfig().search_settings(),
                                           KERNELS)
    assert problem is not None and "mapped from the checkpoint" in problem


def test_pack_weights_false_leaves_every_weight_plain(fresh: LoadedModel) -> None:
    settings = EngineConfig(pack_weights=False).search_settings()
    verdict = route_search.search_route(fresh, settings)
    route_search.build_forward(fresh, verdict)
    assert not verdict.packed
    assert packed_count(route_search.packable_projections(fresh.model)) == 0


@needs_onednn
def test_a_stopped_engine_leaves_its_model_plain(fresh: LoadedModel) -> None:
    engine = Engine(loaded=fresh, cache=None, config=EngineConfig(block_tokens=16),
                    deployment_secret=SECRET, kernels=KERNELS)
    engine.start()
    engine.stop(grace_s=0)
    assert packed_count(route_search.packable_projections(fresh.model)) == 0


@pytest.fixture
def tied(tmp_path: Path) -> LoadedModel:
    """A tiny Llama whose logits head is its embeddings' table (as SmolLM2's)."""
    return load_model(str(save_tiny_llama(tmp_path / "tied", tied=True)))


@needs_panels
def test_the_search_lays_a_llamas_weights_out_in_panels(tied: LoadedModel) -> None:
    verdict = route_search.search_route(tied, EngineConfig().search_settings())
    assert (verdict.kernel, verdict.packed) == ("panels", True)
    assert "pnl16+rms8-r1x1" in route_search.route_of(verdict).attention
    route_search.build_forward(tied, verdict)
    projections = route_search.packable_projections(tied.model)
    assert packed_count(projections) == len(projections) > 0
    assert all(isinstance(where.module.weight, Panels) for where in projections)


@needs_panels
def test_a_tied_head_and_its_embeddings_share_one_copy_in_panels(tied: LoadedModel) -> None:
    table = _weight(tied.model.model.embed_tokens).clone()
    route_search.build_forward(tied, route_search.search_route(
        tied, EngineConfig().search_settings()))
    embeddings, head = tied.model.model.embed_tokens, tied.model.lm_head
    assert isinstance(embeddings, PackedEmbedding) and isinstance(head, PackedLinear)
    assert head.weight is embeddings.weight
    ids = torch.tensor([[0, 7, 511]])
    assert torch.equal(embeddings(ids), table[ids])


@needs_panels
def test_a_model_in_panels_reads_back_plain_through_its_state_dict(tied: LoadedModel) -> None:
    plain = {name: tensor.clone() for name, tensor in tied.model.state_dict().items()}
    route_search.build_forward(tied, route_search.search_route(
        tied, EngineConfig().search_settings()))
    state = tied.model.state_dict()
    assert state.keys() == plain.keys()
    assert all(torch.equal(state[name], plain[name]) for name in plain)


@needs_panels
def test_a_stopped_engine_puts_the_tied_head_back_over_one_plain_table(
        tied: LoadedModel) -> None:
    embeddings, head = tied.model.model.embed_tokens, tied.model.lm_head
    table = _weight(embeddings).clone()
    engine = Engine(loaded=tied, cache=None, config=EngineConfig(block_tokens=16),
                    deployment_secret=SECRET, kernels=KERNELS)
    engine.start()
    assert isinstance(tied.model.model.embed_tokens, PackedEmbedding)
    engine.stop(grace_s=0)
    assert tied.model.model.embed_tokens is embeddings and tied.model.lm_head is head
    assert head.weight is embeddings.weight
    assert torch.equal(_weight(embeddings), table)


@needs_panels
def test_linear_kernel_onednn_is_never_served_by_panels(tied: LoadedModel) -> None:
    verdict = route_search.search_route(tied,
                                        EngineConfig(linear_kernel="onednn").search_settings())
    assert verdict.kernel != "panels"


def test_a_model_loaded_through_transformers_is_not_given_panels(tmp_path: Path) -> None:
    """Its weights are mapped from the file: panels would be a second copy beside them."""
    loaded = load_model(str(save_qwen2(tmp_path / "qwen2")))
    verdict = route_search.search_route(loaded, EngineConfig().search_settings())
    assert verdict.kernel != "panels"


@needs_panels
def test_a_qwen3_checkpoint_read_by_kvgate_is_given_panels(tmp_path: Path) -> None:
    """Qwen3 is read by kvgate's own reader (``checkpoint_dialects``): its weights are its
    own, so the search lays them out for the panel kernel as it does a Llama's."""
    loaded = load_model(str(save_qwen3(tmp_path / "qwen3")))
    assert loaded.owns_its_weights
    verdict = route_search.search_route(loaded, EngineConfig().search_settings())
    assert verdict.kernel == "panels" and verdict.packed
