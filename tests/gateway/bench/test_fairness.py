"""``kvgate bench fairness`` runs both phases end to end on the tiny Llama."""

from __future__ import annotations

import io
from pathlib import Path

from gateway.bench.fairness import FairnessOptions, run_fairness_benchmark
from tests.tiny_llama import save_tiny_llama


def test_the_fairness_benchmark_times_the_quiet_tenant_alone_and_flooded(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    out = io.StringIO()
    result = run_fairness_benchmark(FairnessOptions(
        model=str(model), cache_dir=tmp_path / "cache", requests=3, flood=2, flood_tokens=60,
        flood_max_tokens=16, max_tokens=2), out=out)
    assert len(result.alone) == len(result.flooded) == 3
    assert all(seconds > 0 for seconds in result.alone + result.flooded)
    assert result.p50_ratio > 0 and result.p99_ratio > 0
    assert "flooded / alone: p50" in out.getvalue()
