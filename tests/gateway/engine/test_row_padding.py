"""The row padding of shared products and its search, on the CPU and CUDA-style.

The search is driven through its ``product`` seam with projections whose rows change with the
row count where real kernels would (split reductions below some count), so that what it finds
is known on every machine; with this machine's own ``F.linear`` the test checks only that what
it found holds. On CUDA the ``gpu``-marked parity suite runs it on real weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gateway.engine.attention.choice import attention_for
from gateway.engine.forward.batched import BatchedForward, projection_weights
from gateway.engine.linear.row_padding import (
    CPU_PADDINGS,
    CPU_ROW_PADDING,
    RowPadding,
    checked_counts,
    find_row_padding,
    find_shape_paddings,
    row_padding_for,
    sampled_counts,
)
from gateway.engine.linear.row_products import RowProducts
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity.probe import probe_invariance
from tests.gateway.engine.kernels import rowwise
from tests.tiny_llama import VOCAB, save_tiny_llama

WEIGHTS = [torch.randn(48, 32, generator=torch.Generator().manual_seed(1)),
           torch.randn(32, 80, generator=torch.Generator().manual_seed(2))]


def _split_below(count: int):
    """A projection whose rows come out rounded differently below ``count`` rows."""
    def product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = F.linear(rows, weight)
        return out.to(torch.bfloat16).to(out.dtype) if rows.shape[0] < count else out
    return product


@pytest.mark.parametrize(("rows", "padded"), [(0, 0), (1, 256), (255, 256), (256, 256),
                                               (257, 320), (1000, 1024)])
def test_a_device_padding_rounds_up_to_its_multiple_from_its_minimum(rows, padded) -> None:
    assert RowPadding(minimum=256, multiple=64).rows_for(rows) == padded


def test_the_first_cpu_padding_is_four_eight_twelve_then_the_count_itself() -> None:
    assert [CPU_ROW_PADDING.rows_for(n) for n in (1, 4, 5, 9, 12, 13, 700)] == \
        [4, 4, 8, 12, 12, 13, 700]
    assert CPU_ROW_PADDING.label == ""
    assert RowPadding(minimum=256, multiple=64).label == "r256x64"
    assert RowPadding(minimum=4, multiple=8, exact_from=64).label == "r4x8e64"


def test_the_checked_counts_are_every_count_the_padding_can_produce() -> None:
    assert checked_counts(256, 600) == [256, 320, 384, 448, 512, 576, 640]


def test_sampled_counts_keep_every_small_count_those_by_each_power_of_two_and_the_largest(
) -> None:
    counts = sampled_counts(CPU_ROW_PADDING, 1024)
    assert counts[:3] == [4, 8, 12] and set(range(12, 65)) <= set(counts)
    assert {127, 128, 129, 511, 512, 513, 1024} <= set(counts)
    assert set(counts) <= set(CPU_ROW_PADDING.counts(1024)) and len(counts) < 100


def test_the_search_finds_the_smallest_minimum_from_which_rows_keep_their_bits() -> None:
    found = find_row_padding(WEIGHTS, max_rows=1024, product=_split_below(256))
    assert found == RowPadding(minimum=256, multiple=64)


def _exact(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A product no row count changes (each row alone), for what a padding search finds."""
    return rowwise(rows, weight, None)


def _exact_but_below(count: int, out_features: int):
    """``_exact``, but the weights with ``out_features`` rows round differently below
    ``count`` rows."""
    def product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = _exact(rows, weight)
        if weight.shape[0] == out_features and rows.shape[0] < count:
            return out.to(torch.bfloat16).to(out.dtype)
        return out
    return product


def test_a_one_row_product_that_keeps_its_bits_is_not_padded() -> None:
    found = find_row_padding(WEIGHTS, max_rows=256, product=_exact)
    assert found == RowPadding(minimum=1, multiple=64)
    assert [found.rows_for(n) for n in (1, 2, 64, 65)] == [1, 64, 64, 128]


def test_each_weight_shape_gets_the_first_padding_that_keeps_its_own_rows() -> None:
    found = find_shape_paddings(WEIGHTS, max_rows=256, product=_exact_but_below(128, 32))
    assert found == {(48, 32): RowPadding(minimum=1, multiple=64),
                     (32, 80): RowPadding(minimum=128, multiple=64)}


def test_a_shape_no_padding_holds_for_leaves_no_shape_paddings() -> None:
    candidates = [RowPadding(minimum=64, multiple=64)]
    assert find_shape_paddings(WEIGHTS, max_rows=256, candidates=candidates,
                               product=_exact_but_below(256, 48)) is None


def test_a_count_that_changes_rows_above_a_minimum_rules_that_minimum_out() -> None:
    def odd_at_640(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = F.linear(rows, weight)
        return out.to(torch.bfloat16).to(out.dtype) if rows.shape[0] == 640 else out
    assert find_row_padding(WEIGHTS, max_rows=1024, product=odd_at_640) == \
        RowPadding(minimum=1024, multiple=64)


def test_no_padding_is_found_when_every_candidate_changes_rows() -> None:
    candidates = [RowPadding(minimum=64, multiple=64), RowPadding(minimum=128, multiple=64)]
    assert find_row_padding(WEIGHTS, max_rows=1024, candidates=candidates,
                            product=_split_below(1024)) is None


@pytest.mark.parametrize(("splits_below", "expected"), [
    (1, CPU_ROW_PADDING), (4, CPU_ROW_PADDING), (12, RowPadding(minimum=16, multiple=16)),
    (20, RowPadding(minimum=32, multiple=32)), (64, RowPadding(minimum=64, multiple=64)),
    (65, None)])
def test_on_a_cpu_the_search_takes_the_first_padding_whose_counts_keep_the_rows(
        splits_below, expected) -> None:
    found = row_padding_for(torch.device("cpu"), WEIGHTS, max_rows=1024,
                            product=_split_below(splits_below))
    assert found == expected


def test_what_the_search_finds_for_this_machines_blas_keeps_every_sampled_row() -> None:
    found = row_padding_for(torch.device("cpu"), WEIGHTS, max_rows=1024)
    assert found is None or found in CPU_PADDINGS
    if found is not None:
        for weight in WEIGHTS:
            rows = torch.randn(found.rows_for(1024), weight.shape[1],
                               generator=torch.Generator().manual_seed(4))
            every = F.linear(rows, weight)
            for count in sampled_counts(found, 1024):
                assert torch.equal(F.linear(rows[:count], weight), every[:count]), count


def test_the_search_stops_when_cancelled() -> None:
    assert row_padding_for(torch.device("cpu"), WEIGHTS, max_rows=1024,
                           cancelled=lambda: True) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def test_projection_weights_are_every_projection_shape_once(tiny) -> None:
    layer = tiny.model.model.layers[0]
    weights = projection_weights(tiny.model)
    every = [module.weight for module in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    assert sorted(tuple(w.shape) for w in weights) == sorted({tuple(w.shape) for w in every})
    assert weights[0] is layer.self_attn.q_proj.weight


def test_the_forward_padded_as_on_a_gpu_passes_the_probe(tiny) -> None:
    """Padding to 64 rows (with products that keep every row, so that what is checked is the
    forward's padding, not this machine's BLAS)."""
    padded = BatchedForward(tiny.model, attention_for(torch.device("cpu")),
                            RowProducts(kernel="blas", padding=RowPadding(minimum=64, multiple=64),
                                        shares_decode_rows=False, product_override=rowwise))
    result = probe_invariance(padded, tiny.layout, VOCAB)
    assert result.is_invariant, result.failure
