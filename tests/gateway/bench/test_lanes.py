"""``kvgate bench fairness --lanes`` runs its three phases end to end on the tiny Llama."""

from __future__ import annotations

import io
from pathlib import Path

from gateway.bench.lanes import LanesOptions, run_lanes_benchmark
from tests.tiny_llama import save_tiny_llama


def test_the_lanes_benchmark_times_interactive_chats_alone_and_beside_both_bulk_lanes(
        tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    out = io.StringIO()
    result = run_lanes_benchmark(LanesOptions(
        model=str(model), cache_dir=tmp_path / "cache", requests=4, flood=2, flood_tokens=60,
        flood_max_tokens=16, max_tokens=2), out=out)
    assert [len(phase.ttfts) for phase in result.phases] == [4, 4, 4]
    assert all(seconds > 0 for phase in result.phases for seconds in phase.ttfts)
    assert result.one_lane.preemptions == 0  # one priority: nothing to preempt for
    # the bulk still finishing: every bulk user's request in flight ended after the chats
    assert result.one_lane.bulk_catch_up_s is not None
    assert result.two_lanes.bulk_catch_up_s is not None
    assert "Target (issue 28): two lanes p99 / alone" in out.getvalue()
