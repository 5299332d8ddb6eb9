"""The panels route's RMSNorm: one C call a norm, each row's bits its own and the same on
every CPU, within float rounding of the torch module it replaces."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.engine import EngineConfig
from gateway.engine.linear.row_norms import (
    RowNormKernel,
    RowRMSNorm,
    kernel,
    swap_in_row_norms,
    swap_out_row_norms,
)
from gateway.engine.models.llama_modules import RMSNorm
from gateway.engine.models.loading import load_model
from gateway.engine.native.build import NativeBuildError
from gateway.engine.parity import route_search
from tests.tiny_llama import save_tiny_llama

try:
    kernel()
    PROBLEM = None
except NativeBuildError as exc:
    PROBLEM = str(exc)
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"no row norm kernel: {PROBLEM}")


def _rows(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("shape", [(5, 576), (2, 9, 64), (1, 13)])
def test_a_norm_is_within_float_rounding_of_the_torch_module(shape) -> None:
    weight = _rows(shape[-1:], 1)
    rows = _rows(shape, 2)
    expected = RMSNorm(weight, 1e-6)(rows)
    got = RowRMSNorm(RMSNorm(weight, 1e-6))(rows)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=4e-7, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 200), count=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(width, count, seed) -> None:
    weight, rows = _rows((width,), seed), _rows((count, width), seed + 1)
    together = kernel()(rows, weight, 1e-5)
    for i in range(count):
        assert torch.equal(kernel()(rows[i:i + 1], weight, 1e-5), together[i:i + 1])


@settings(max_examples=30, deadline=None)
@given(width=st.integers(1, 200), count=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_the_portable_build_computes_the_vectorised_builds_bits(width, count, seed) -> None:
    portable = RowNormKernel.load(portable=True)
    weight, rows = _rows((width,), seed), _rows((count, width), seed + 1)
    assert torch.equal(portable(rows, weight, 1e-6), kernel()(rows, weight, 1e-6))


def test_rows_it_cannot_compute_are_refused() -> None:
    with pytest.raises(ValueError, match="float32 rows of 8 on the CPU"):
        kernel()(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="float32 rows of 8"):
        kernel()(torch.ones(2, 7), torch.ones(8), 1e-6)


def test_swapping_in_and_out_restores_the_very_modules(tmp_path: Path) -> None:
    model = load_model(str(save_tiny_llama(tmp_path / "model"))).model
    before = {name: module for name, module in model.named_modules()
              if isinstance(module, RMSNorm)}
    assert swap_in_row_norms(model) == len(before) > 0
    assert not any(isinstance(m, RMSNorm) for m in model.modules())
    assert swap_out_row_norms(model) == len(before)
    assert {name: module for name, module in model.named_modules()
            if isinstance(module, RMSNorm)} == before


def test_the_panels_route_computes_its_norms_by_the_kernel_and_its_namespace_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    loaded = load_model(str(save_tiny_llama(tmp_path / "model")))
    with caplog.at_level(logging.INFO, logger=route_search.__name__):
        verdict = route_search.search_route(loaded, EngineConfig().search_settings())
        route_search.build_forward(loaded, verdict)
    if verdict.kernel != "panels":
        pytest.skip(f"the search chose {verdict.kernel} here")
    layers = len(loaded.model.model.layers)
    assert f"{2 * layers + 1} RMSNorms computed by the row kernel" in caplog.text
    assert isinstance(loaded.model.model.norm, RowRMSNorm)
    assert "+rms8-" in route_search.route_of(verdict).attention
    route_search.unpack_model(loaded)
    assert isinstance(loaded.model.model.norm, RMSNorm)
