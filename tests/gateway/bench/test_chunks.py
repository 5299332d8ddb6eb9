"""``kvgate bench chunks`` runs end to end on the tiny Llama and prints every variant."""

from __future__ import annotations

import io
from pathlib import Path

from gateway.bench.chunks import run_chunks_benchmark
from tests.tiny_llama import save_tiny_llama


def test_the_chunks_benchmark_times_every_size_and_both_references(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    out = io.StringIO()
    medians = run_chunks_benchmark(model=str(model), cache_dir=tmp_path / "cache",
                                   sizes=[16, 64], prompt_tokens=96, repeats=1, out=out)
    assert set(medians) == {"batched, chunks of 16", "batched, chunks of 64",
                            "transformers, one shot", "serial route, 256-token chunks"}
    assert all(seconds > 0 for seconds in medians.values())
    assert "vs one shot" in out.getvalue()
