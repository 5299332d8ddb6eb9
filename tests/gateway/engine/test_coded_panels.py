"""Weights kept as 4- or 8-bit codes in panels: only where expanding the codes gives back every
bit of the weight, and then every product has the bits it has over whole panels."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.attention.tiled import TiledAttention
from gateway.engine.engine import EngineConfig
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.coded_panels import (
    BFLOAT16,
    BLOCK,
    EIGHT_BITS,
    FOUR_BITS,
    CodedBlocks,
)
from gateway.engine.linear.joined_panels import join_panels
from gateway.engine.linear.packed_weights import (
    PANEL_LAYOUT,
    WeightLayout,
    pack_projections,
)
from gateway.engine.linear.panel_products import (
    PanelKernel,
    Panels,
    panel_kernel_problem,
    panel_product,
)
from gateway.engine.linear.row_padding import RowPadding
from gateway.engine.linear.row_products import RowProducts
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity import route_search
from tests.tiny_llama import save_tiny_llama

PROBLEM = panel_kernel_problem(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"no panel kernel here: {PROBLEM}")


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], -1, BLOCK)


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` through a GGUF's Q4_1 and back, as its dequantiser computes it: per block of
    32, ``code * d + m`` in float32, ``d`` and ``m`` float16, codes 0-15."""
    blocks = _blocks(weight)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = ((high - low) / 15).half().float().unsqueeze(-1)
    m = low.half().float().unsqueeze(-1)
    codes = torch.round((blocks - m) / torch.where(d == 0, 1, d)).clamp(0, 15).to(torch.int8)
    return (codes.float() * d + m).reshape(weight.shape)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` through a GGUF's Q8_0 and back: per block of 32, ``code * d``, ``d``
    float16, codes -127-127 (integers: a code of 0 is +0.0)."""
    blocks = _blocks(weight)
    d = (blocks.abs().amax(-1) / 127).half().float().unsqueeze(-1)
    codes = torch.round(blocks / torch.where(d == 0, 1, d)).clamp(-127, 127).to(torch.int8)
    return (codes.float() * d).reshape(weight.shape)


def bfloat16s(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a bfloat16 checkpoint holds it, read back in float32."""
    return weight.to(torch.bfloat16).to(torch.float32)


QUANTISERS = {"q4_1": q4_1, "q8_0": q8_0, "bfloat16": bfloat16s}


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


def _weight(outputs: int, blocks: int, seed: int) -> torch.Tensor:
    return torch.randn(outputs, blocks * BLOCK, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("quantise", "coding"),
                         [(q4_1, FOUR_BITS), (q8_0, EIGHT_BITS), (bfloat16s, BFLOAT16)])
def test_a_ggufs_blocks_are_kept_as_codes_that_read_back_every_bit(quantise, coding) -> None:
    weight = quantise(_weight(40, 3, seed=1))
    panels = Panels.of(weight)
    assert panels.coding == coding
    assert panels.shape == weight.shape and panels.dtype == torch.float32
    assert torch.equal(_bits(panels.plain()), _bits(weight))
    ids = torch.tensor([[0, 17, 39], [5, 5, 16]])
    assert torch.equal(_bits(panels.row(ids)), _bits(weight[ids]))


def test_four_bit_codes_take_under_a_fifth_of_the_weights_bytes() -> None:
    weight = q4_1(_weight(64, 8, seed=2))
    assert Panels.of(weight).nbytes * 5 < weight.nbytes


def test_bfloat16s_take_half_the_weights_bytes() -> None:
    weight = bfloat16s(_weight(64, 8, seed=2))
    assert Panels.of(weight).nbytes * 2 == weight.nbytes


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 4), outputs=st.integers(1, 70),
       seed=st.integers(0, 2**16), quantiser=st.sampled_from(sorted(QUANTISERS)),
       with_bias=st.booleans())
def test_codes_give_the_products_of_whole_panels_bit_for_bit(
        rows: int, blocks: int, outputs: int, seed: int, quantiser: str,
        with_bias: bool) -> None:
    weight = QUANTISERS[quantiser](_weight(outputs, blocks, seed))
    generator = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, blocks * BLOCK, generator=generator)
    bias = torch.randn(outputs, generator=generator) if with_bias else None
    coded, whole = Panels.of(weight), Panels.of(weight, coded=False)
    assert coded.coding is not None and whole.coding is None
    assert torch.equal(_bits(panel_product(x, coded, bias)),
                       _bits(panel_product(x, whole, bias)))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 30), blocks=st.integers(1, 3), outputs=st.integers(1, 50),
       seed=st.integers(0, 2**16), quantiser=st.sampled_from(sorted(QUANTISERS)))
def test_the_portable_build_gives_the_vectorised_builds_bits_over_codes(
        rows: int, blocks: int, outputs: int, seed: int, quantiser: str) -> None:
    weight = QUANTISERS[quantiser](_weight(outputs, blocks, seed))
    x = torch.randn(rows, blocks * BLOCK, generator=torch.Generator().manual_seed(seed))
    coded = Panels.of(weight)
    assert torch.equal(_bits(PanelKernel.load(portable=True)(x, coded)),
                       _bits(panel_product(x, coded, None)))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 30), blocks=st.integers(1, 3), outputs=st.integers(1, 50),
       seed=st.integers(0, 2**16), quantiser=st.sampled_from(sorted(QUANTISERS)))
def test_the_eight_lane_build_gives_the_portable_builds_bits_over_codes(
        rows: int, blocks: int, outputs: int, seed: int, quantiser: str) -> None:
    """Without AVX-512 (an AVX2 machine's build) the codes are expanded by another path."""
    weight = QUANTISERS[quantiser](_weight(outputs, blocks, seed))
    x = torch.randn(rows, blocks * BLOCK, generator=torch.Generator().manual_seed(seed))
    coded = Panels.of(weight)
    assert torch.equal(_bits(PanelKernel.load(wide_vectors=False)(x, coded)),
                       _bits(PanelKernel.load(portable=True)(x, coded)))


def test_a_weight_of_float32_numbers_stays_in_whole_panels() -> None:
    assert Panels.of(_weight(20, 2, seed=3)).coding is None


def test_one_number_a_bit_off_its_codes_keeps_the_weight_whole() -> None:
    weight = q4_1(_weight(20, 2, seed=4))
    weight[13, 40] = torch.nextafter(weight[13, 40], torch.tensor(float("inf")))
    assert CodedBlocks.of(weight) is None
    assert torch.equal(_bits(Panels.of(weight).plain()), _bits(weight))


def test_a_negative_zero_is_not_coded_as_zero() -> None:
    """A code of zero expands to +0.0; a weight's -0.0 would change a product's zero's sign."""
    weight = q8_0(_weight(16, 1, seed=5))
    weight[3, 7] = -0.0
    assert CodedBlocks.of(weight) is None


def test_inputs_that_are_not_whole_blocks_stay_whole() -> None:
    weight = q4_1(_weight(16, 2, seed=6))[:, :40]
    assert Panels.of(weight).coding is None


def _quantised(directory: Path) -> LoadedModel:
    """A tiny tied Llama whose projections are Q4_1's numbers and embeddings Q8_0's (what the
    bundled SmolLM2's GGUF holds)."""
    loaded = load_model(str(directory))
    with torch.no_grad():
        for where in route_search.packable_projections(loaded.model):
            weight = where.module.weight
            assert isinstance(weight, torch.Tensor)
            weight.copy_(q4_1(weight))
        table = loaded.model.model.embed_tokens.weight
        table.copy_(q8_0(table))
    return loaded


def _logits(loaded: LoadedModel) -> list[torch.Tensor]:
    forward = BatchedForward(loaded.model, TiledAttention(),
                             RowProducts.of("panels", RowPadding(minimum=1, multiple=1)),
                             loaded.features)
    sequences = [KVSequence.alone(loaded.layout, 64) for _ in range(3)]
    generator = torch.Generator().manual_seed(7)
    tokens = [torch.randint(0, 400, (40,), generator=generator) for _ in sequences]
    logits = [x for x in forward.forward([
        SequenceRows(sequence=seq, tokens=ids[:37], wants_logits=True)
        for seq, ids in zip(sequences, tokens, strict=True)]) if x is not None]
    for at in range(37, 40):
        logits += [x for x in forward.forward([
            SequenceRows(sequence=seq, tokens=ids[at:at + 1], wants_logits=True,
                         is_decode=True)
            for seq, ids in zip(sequences, tokens, strict=True)]) if x is not None]
    return logits


def test_a_quantised_models_forward_over_codes_is_its_forward_over_whole_panels(
        tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path / "model", tied=True)
    coded, whole = _quantised(directory), _quantised(directory)
    whole_layout = WeightLayout("panels", lambda w: Panels.of(w, coded=False),
                                PANEL_LAYOUT.plain, looks_up_rows=True)
    for loaded, layout in ((coded, PANEL_LAYOUT), (whole, whole_layout)):
        pack_projections(route_search.packable_projections(loaded.model), layout)
        join_panels(loaded.model)
    weights = [where.module.weight for where in route_search.packable_projections(coded.model)]
    assert {w.coding for w in weights if isinstance(w, Panels)} == {FOUR_BITS}
    assert all(isinstance(w, Panels) for w in weights)
    pairs = zip(_logits(coded), _logits(whole), strict=True)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in pairs)


def test_the_search_keeps_a_quantised_models_weights_and_tied_head_as_codes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    loaded = _quantised(save_tiny_llama(tmp_path / "model", tied=True))
    table = loaded.model.model.embed_tokens.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger=route_search.__name__):
        route_search.build_forward(loaded, route_search.search_route(
            loaded, EngineConfig().search_settings()))
    assert "14 as 4-bit codes, 1 as 8-bit codes: " in caplog.text
    head = loaded.model.lm_head.weight
    assert isinstance(head, Panels) and head.coding == EIGHT_BITS
    ids = torch.tensor([[1, 2, 300]])
    assert torch.equal(_bits(loaded.model.model.embed_tokens(ids)), _bits(table[ids]))
