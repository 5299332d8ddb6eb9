"""``kvgate bench chunks`` runs end to end on the tiny Llama and prints every variant, on the
device and in the dtype it was given."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gateway.bench.chunks import run_chunks_benchmark
from gateway.bench.numerics import resolve_numerics
from tests.tiny_llama import save_tiny_llama


@pytest.mark.parametrize(("device", "dtype"), [
    ("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
def test_the_chunks_benchmark_times_every_size_and_both_references(
    tmp_path: Path, device: str, dtype: str,
) -> None:
    numerics = resolve_numerics(device, dtype)
    model = save_tiny_llama(tmp_path / "model")
    out = io.StringIO()
    medians = run_chunks_benchmark(model=str(model), cache_dir=tmp_path / "cache",
                                   sizes=[16, 64], prompt_tokens=96, repeats=1, out=out,
                                   numerics=numerics)
    assert set(medians) == {"batched, chunks of 16", "batched, chunks of 64",
                            "transformers, one shot", "serial route, 256-token chunks"}
    assert all(seconds > 0 for seconds in medians.values())
    assert "vs one shot" in out.getvalue()
    assert "cold prefill of 96 tokens" in out.getvalue()
    assert f" {numerics.describe()}, median of 1" in out.getvalue()
