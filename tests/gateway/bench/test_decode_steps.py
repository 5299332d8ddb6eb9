"""``python -m gateway.bench.decode_steps``: eager and captured decode steps timed side by side,
and where steps cannot be captured, the reason (gateway.bench.decode_steps)."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest

from gateway.bench.decode_steps import main, run_decode_benchmark, time_decode_steps
from gateway.bench.numerics import resolve_numerics
from gateway.engine.attention.triton_paged import TritonPagedAttention
from gateway.engine.forward.batched import BatchedForward
from gateway.engine.forward.captured_steps import CapturedSteps
from gateway.engine.linear.row_padding import RowPadding
from gateway.engine.linear.row_products import RowProducts
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.kernels import rowwise
from tests.gateway.engine.triton_interpreter import interpreted
from tests.tiny_llama import save_tiny_llama
from tiers.page_pool import PagePool


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_on_the_cpu_it_times_the_eager_step_and_says_why_none_is_captured(tiny_dir) -> None:
    out = io.StringIO()
    rows = run_decode_benchmark(model=str(tiny_dir), rows=[1, 3], context=40, repeats=2,
                                numerics=resolve_numerics("cpu", "float32"), out=out)
    assert [row.rows for row in rows] == [1, 3]
    assert all(row.eager_ms > 0 and row.captured_ms is None for row in rows)
    text = out.getvalue()
    assert "captured steps: not here (" in text
    assert "reading every weight once:" in text
    assert "\n3 | " in text


@pytest.mark.parametrize("rows", ["0", "1,x", ""])
def test_row_counts_that_are_not_positive_integers_are_refused(rows, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--model", "unused", "--rows", rows])
    assert "row counts are positive integers" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@interpreted
def test_captured_steps_are_timed_beside_the_eager_ones(tiny_dir) -> None:
    loaded: LoadedModel = load_model(str(tiny_dir))
    products = RowProducts(kernel="onednn", padding=RowPadding(minimum=4, multiple=4),
                           shares_decode_rows=True, product_override=rowwise)
    forward = BatchedForward(loaded.model, TritonPagedAttention(), products)
    pool = PagePool(loaded.layout, page_tokens=16, num_pages=64)
    captured = CapturedSteps(forward, pool, max_rows=3, max_positions=256, capture=False)
    rows = time_decode_steps(loaded, forward, resolve_numerics("cpu", "float32"), rows=[1, 3],
                             context=20, repeats=2, captured=captured, captured_pool=pool)
    assert all(row.captured_ms is not None and row.captured_ms > 0 for row in rows)
    counters = captured.counters  # a first step and two timed per row count, one bucket (4)
    assert (counters.verified, counters.eager, counters.replayed) == (1, 2, 4)
