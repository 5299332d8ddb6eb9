"""The forward's row products: oneDNN with every row of a step in one product (decode rows too),
BLAS with decode rows alone, each kernel's padding searched on the machine, and the choice.

What a kernel does on this machine is never assumed: the choices are driven through the
``kernels`` seam (``tests.gateway.engine.kernels``: a kernel that keeps every row, one whose
rows change below some count, one that raises), and the machine's own kernels are only checked
to keep the rows the search said they keep.
"""

from __future__ import annotations

import logging

import pytest
import torch

from gateway.engine.attention.choice import attention_for
from gateway.engine.engine import EngineConfig
from gateway.engine.forward.batched import BatchedForward, SequenceRows, projection_weights
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.linear.row_padding import CPU_ROW_PADDING, RowPadding
from gateway.engine.linear.row_products import (
    BLAS_CPU_PRODUCTS,
    KERNELS,
    ONEDNN_ROW_PADDING,
    RowProducts,
    candidate_row_products,
    kernel_problem,
    step_and_wider,
)
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity.probe import probe_invariance
from tests.gateway.engine.kernels import (
    ROWWISE_KERNELS,
    raising,
    rowwise,
    varies_below,
    varies_with_count,
)
from tests.tiny_llama import VOCAB, save_tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")),
                      device=torch.device("cuda"), dtype=torch.bfloat16)


def _candidates(tiny: LoadedModel, kernel: str = "auto",
                kernels=ROWWISE_KERNELS) -> list[RowProducts]:
    return candidate_row_products(CPU, projection_weights(tiny.model),
                                  tiny.model.lm_head.weight, max_rows=1024, max_logit_rows=16,
                                  kernel=kernel, kernels=kernels)  # type: ignore[arg-type]


def _shape(products: RowProducts) -> tuple[str, RowPadding, bool]:
    return products.kernel, products.padding, products.shares_decode_rows


def test_onednn_pads_one_or_two_rows_to_two_and_more_to_a_multiple_of_eight() -> None:
    assert [ONEDNN_ROW_PADDING.rows_for(n) for n in (0, 1, 2, 3, 8, 9, 1000)] == \
        [0, 2, 2, 8, 8, 16, 1000]
    onednn = RowProducts(kernel="onednn", padding=ONEDNN_ROW_PADDING, shares_decode_rows=True)
    assert onednn.label == "dnnl-r2x8"
    assert BLAS_CPU_PRODUCTS.label == ""  # the CPU namespaces made before oneDNN


def test_with_kernels_that_keep_every_row_onednn_comes_first_then_blas(tiny) -> None:
    assert [_shape(p) for p in _candidates(tiny)] == [
        ("onednn", ONEDNN_ROW_PADDING, True), ("blas", CPU_ROW_PADDING, False)]


def test_decode_rows_join_the_padded_product_of_blas_only_on_a_gpu() -> None:
    gemm = RowProducts.of("gemm", RowPadding(minimum=256, multiple=64))
    assert gemm.shares_decode_rows and gemm.label == "gemm-r256x64"
    assert not RowProducts.of("blas", RowPadding(minimum=256, multiple=64)).shares_decode_rows
    problem = kernel_problem("gemm", CPU, torch.float32)
    assert problem is not None and "GPU only" in problem


def test_on_the_cpu_the_real_kernels_never_offer_gemm(tiny, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="gateway.engine.linear.row_products"):
        found = _candidates(tiny, kernels=KERNELS)
    assert "gemm" not in [p.kernel for p in found]
    assert any("gemm dropped" in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
def test_on_cuda_gemm_comes_first_with_decode_rows_shared(tiny_cuda) -> None:
    found = candidate_row_products(torch.device("cuda"), projection_weights(tiny_cuda.model),
                                   tiny_cuda.model.lm_head.weight, max_rows=1024,
                                   max_logit_rows=16)
    assert [p.kernel for p in found][:1] == ["gemm"] and found[0].shares_decode_rows


def test_linear_kernel_blas_offers_blas_only(tiny) -> None:
    assert [_shape(p) for p in _candidates(tiny, "blas")] == [("blas", CPU_ROW_PADDING, False)]


def test_a_kernel_the_machine_cannot_run_is_dropped_with_one_line_naming_why(
        tiny, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gateway.engine.linear.row_products"):
        found = _candidates(tiny, kernels={"onednn": raising, "blas": rowwise})
    assert [p.kernel for p in found] == ["blas"]
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and "onednn" in lines[0] and "primitive descriptor" in lines[0]


def test_asking_for_onednn_where_it_cannot_run_warns_and_offers_blas(
        tiny, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.engine.linear.row_products"):
        found = _candidates(tiny, "onednn", kernels={"onednn": raising, "blas": rowwise})
    assert [p.kernel for p in found] == ["blas"]
    assert any(r.levelno == logging.WARNING and "onednn" in r.getMessage()
               for r in caplog.records)


def test_a_kernel_whose_small_products_differ_gets_a_coarser_padding(tiny) -> None:
    found = _candidates(tiny, kernels={"onednn": varies_below(12), "blas": varies_below(12)})
    assert [_shape(p) for p in found] == [
        ("onednn", RowPadding(minimum=16, multiple=16), True),
        ("blas", RowPadding(minimum=16, multiple=16), False)]


def test_a_kernel_whose_rows_change_under_every_padding_is_dropped(
        tiny, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="gateway.engine.linear.row_products"):
        found = _candidates(tiny, kernels={"onednn": rowwise, "blas": varies_with_count})
    assert [p.kernel for p in found] == ["onednn"]
    assert any("blas dropped" in r.getMessage() and "every padding" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_padding_found_for_this_machines_kernels_keeps_a_rows_bits_at_every_count(
        tiny, dtype) -> None:
    weights = [w.to(dtype) for w in projection_weights(tiny.model)]
    head = tiny.model.lm_head.weight.to(dtype)
    found = candidate_row_products(CPU, weights, head, max_rows=200, max_logit_rows=16)
    runnable = [name for name in KERNELS if kernel_problem(name, CPU, dtype) is None]
    assert {p.kernel for p in found} <= set(runnable)
    generator = torch.Generator().manual_seed(3)
    for products in found:
        for weight in weights:
            rows = torch.randn(products.padding.rows_for(200), weight.shape[1],
                               generator=generator).to(dtype)
            every = products.product(rows, weight, None)
            for count in products.padding.counts(200):
                assert torch.equal(products.product(rows[:count], weight, None),
                                   every[:count]), (products.kernel, count)


def test_an_unknown_linear_kernel_is_refused() -> None:
    with pytest.raises(ValueError, match="linear_kernel"):
        EngineConfig(linear_kernel="mkl")  # type: ignore[arg-type]


def test_with_decode_rows_in_the_shared_product_a_decoded_token_writes_a_prefills_k_v(
        tiny: LoadedModel) -> None:
    """Decode rows share the product (oneDNN's way) and the attention pads them as prefill
    rows: their K/V are a prefill's (the products keep every row, so any machine runs this)."""
    shared = RowProducts(kernel="onednn", padding=ONEDNN_ROW_PADDING, shares_decode_rows=True,
                         product_override=rowwise)
    forward = BatchedForward(tiny.model, attention_for(CPU, decode_as_prefill=True), shared)
    tokens = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(5))
    prefilled = KVSequence.alone(tiny.layout, 80)
    forward.forward([SequenceRows(sequence=prefilled, tokens=tokens, wants_logits=False)])
    decoded = KVSequence.alone(tiny.layout, 80)
    forward.forward([SequenceRows(sequence=decoded, tokens=tokens[:66], wants_logits=False)])
    other = KVSequence.alone(tiny.layout, 80)
    for at in range(66, 70):  # each decode row beside another sequence's prefill chunk
        forward.forward([
            SequenceRows(sequence=other, tokens=tokens[at - 66:at - 63], wants_logits=True),
            SequenceRows(sequence=decoded, tokens=tokens[at:at + 1], wants_logits=True,
                         is_decode=True)])
    for layer in range(tiny.layout.num_layers):
        assert torch.equal(decoded.keys(layer), prefilled.keys(layer))
        assert torch.equal(decoded.values(layer), prefilled.values(layer))


# ---- shapes padded further than the step (CUDA's per-shape search) ----------------------

DOWN = (64, 128)
"""The tiny Llama's down projection: ``[hidden, intermediate]``."""


def _varies_below_for(count: int, shape: tuple[int, int]):
    """Rows that keep their bits at every count (``rowwise``), except ``shape``'s below
    ``count`` rows, rounded differently (a kernel splitting small products' reductions)."""
    def product(rows: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        out = rowwise(rows, weight, bias)
        if tuple(weight.shape) == shape and rows.shape[0] < count:
            return out.to(torch.bfloat16).to(out.dtype)
        return out
    return product


def test_a_shape_with_a_padding_of_its_own_multiplies_that_many_rows() -> None:
    counts: list[tuple[tuple[int, ...], int]] = []

    def recording(rows: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        counts.append((tuple(weight.shape), rows.shape[0]))
        return rowwise(rows, weight, bias)

    products = RowProducts(kernel="gemm", padding=RowPadding(minimum=1, multiple=64),
                           shares_decode_rows=True, product_override=recording,
                           wider=((DOWN, RowPadding(minimum=128, multiple=64)),))
    down, up = torch.nn.Linear(128, 64, bias=False), torch.nn.Linear(64, 128, bias=False)
    row = torch.randn(1, 128)
    got = products.project(down, row, 1)
    assert torch.equal(got, rowwise(row, down.weight, None))
    products.project(up, torch.randn(1, 64), 1)
    assert counts == [(DOWN, 128), ((128, 64), 1)]
    assert products.label == "gemm-r1x64+64x128r128x64"


def test_a_forward_whose_one_shape_needs_more_rows_is_invariant_only_with_them(tiny) -> None:
    product = _varies_below_for(128, DOWN)
    step = RowPadding(minimum=1, multiple=64)

    def forward(wider: tuple[tuple[tuple[int, int], RowPadding], ...]) -> BatchedForward:
        return BatchedForward(tiny.model, attention_for(CPU), RowProducts(
            kernel="blas", padding=step, shares_decode_rows=False, product_override=product,
            wider=wider))

    assert not probe_invariance(forward(()), tiny.layout, VOCAB).is_invariant
    result = probe_invariance(forward(((DOWN, RowPadding(minimum=128, multiple=64)),)),
                              tiny.layout, VOCAB)
    assert result.is_invariant, result.failure


def test_the_step_is_padded_as_the_cheapest_shape_and_the_others_pad_further() -> None:
    r1, r128 = RowPadding(minimum=1, multiple=64), RowPadding(minimum=128, multiple=64)
    shapes = {(64, 64): r1, DOWN: r128, (128, 64): r1}
    head = torch.randn(VOCAB, 64)
    exact = _varies_below_for(0, DOWN)

    def unbiased(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return exact(rows, weight, None)

    assert step_and_wider("blas", shapes, head, unbiased, max_logit_rows=16) == \
        (r1, ((DOWN, r128),))
    # gemm: the logits rows join the product, and this head keeps them from one row.
    assert step_and_wider("gemm", shapes, head, unbiased, max_logit_rows=16) == \
        (r1, ((DOWN, r128),))


def test_with_gemm_a_head_that_needs_more_rows_is_padded_further_too() -> None:
    r1 = RowPadding(minimum=1, multiple=64)
    head = torch.randn(VOCAB, 64)
    varies = _varies_below_for(64, (VOCAB, 64))

    def unbiased(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return varies(rows, weight, None)

    assert step_and_wider("gemm", {(64, 64): r1}, head, unbiased, max_logit_rows=16) == \
        (r1, (((VOCAB, 64), RowPadding(minimum=64, multiple=64)),))
