"""The panel kernel: each output number one fused multiply-add per input, in order, so a row's
bits are its own at any row count and the same on every CPU (``native/panel_products.c``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.linear.panel_products import (
    PanelKernel,
    Panels,
    panel_kernel_problem,
    panel_product,
)

PROBLEM = panel_kernel_problem(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"no panel kernel here: {PROBLEM}")


def _case(rows: int, inputs: int, outputs: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, inputs, generator=generator),
            torch.randn(outputs, inputs, generator=generator),
            torch.randn(outputs, generator=generator))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), inputs=st.integers(1, 200), outputs=st.integers(1, 100),
       seed=st.integers(0, 2**16), with_bias=st.booleans())
def test_a_rows_numbers_are_the_same_at_any_row_count(rows: int, inputs: int, outputs: int,
                                                      seed: int, with_bias: bool) -> None:
    x, weight, bias = _case(rows, inputs, outputs, seed)
    panels = Panels.of(weight)
    every = panel_product(x, panels, bias if with_bias else None)
    for row in range(rows):
        alone = panel_product(x[row:row + 1], panels, bias if with_bias else None)
        assert torch.equal(alone[0], every[row])
    assert torch.equal(panel_product(x[rows // 2:], panels, bias if with_bias else None),
                       every[rows // 2:])


def test_inputs_are_summed_in_order() -> None:
    """1e8 + 1 rounds back to 1e8 in float32, so summing in order loses the 1 that a sum in
    any other order (the large ones cancelling first) keeps."""
    x = torch.tensor([[1e8, 1.0, -1e8]])
    ones = torch.ones(1, 3)
    assert panel_product(x, Panels.of(ones), None).item() == 0.0
    assert panel_product(x[:, [0, 2, 1]], Panels.of(ones), None).item() == 1.0


def test_the_bias_is_added_after_the_sum() -> None:
    x = torch.tensor([[1e8, 1.0, -1e8]])
    assert panel_product(x, Panels.of(torch.ones(1, 3)), torch.tensor([0.5])).item() == 0.5


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(1, 30), inputs=st.integers(1, 300), outputs=st.integers(1, 70),
       seed=st.integers(0, 2**16))
def test_the_portable_build_gives_the_vectorised_builds_bits(rows: int, inputs: int,
                                                             outputs: int, seed: int) -> None:
    x, weight, bias = _case(rows, inputs, outputs, seed)
    panels = Panels.of(weight)
    assert torch.equal(PanelKernel.load(portable=True)(x, panels, bias),
                       panel_product(x, panels, bias))


def test_products_agree_with_torch_within_float32_rounding() -> None:
    x, weight, bias = _case(13, 576, 200, seed=1)
    exact = F.linear(x.double(), weight.double(), bias.double())
    assert torch.allclose(panel_product(x, Panels.of(weight), bias).double(), exact,
                          rtol=0, atol=1e-4)


def test_a_plain_weight_is_laid_out_for_the_call() -> None:
    x, weight, _ = _case(3, 40, 33, seed=2)
    assert torch.equal(panel_product(x, weight, None), panel_product(x, Panels.of(weight), None))


def test_panels_read_back_the_plain_weight_and_its_rows_exactly() -> None:
    _, weight, _ = _case(1, 24, 37, seed=3)
    panels = Panels.of(weight)
    assert panels.shape == weight.shape
    assert torch.equal(panels.plain(), weight)
    ids = torch.tensor([0, 15, 16, 36, 5])
    assert torch.equal(panels.row(ids), weight[ids])
    assert torch.equal(panels.row(ids.view(1, 5)), weight[ids].view(1, 5, 24))


def test_rows_of_another_width_or_dtype_are_refused() -> None:
    panels = Panels.of(torch.ones(4, 8))
    with pytest.raises(ValueError, match="do not fit"):
        panel_product(torch.ones(2, 7), panels, None)
    with pytest.raises(ValueError, match="float32"):
        panel_product(torch.ones(2, 8, dtype=torch.float64), panels, None)


def test_no_rows_give_no_rows() -> None:
    assert panel_product(torch.ones(0, 8), Panels.of(torch.ones(4, 8)), None).shape == (0, 4)


def test_only_float32_on_the_cpu_is_multiplied() -> None:
    assert "float32" in (panel_kernel_problem(torch.device("cpu"), torch.bfloat16) or "")
    assert "CPU" in (panel_kernel_problem(torch.device("cuda"), torch.float32) or "")
