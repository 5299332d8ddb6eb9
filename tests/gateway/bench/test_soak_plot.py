"""The soak's PNG (``gateway.bench.soak.plot``): written from a report, tier shares binned."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from gateway.bench.soak.faults import FaultWindow
from gateway.bench.soak.plot import hit_shares, plot_soak
from gateway.bench.soak.processes import ProcessSample
from gateway.bench.soak.report import Sampled, SoakReport
from gateway.bench.soak.workload import Outcome


def _report() -> SoakReport:
    outcomes = [
        Outcome(kind="chat", replica=0, started=1000.0, ended=1002.0, prompt_tokens=400,
                tiers={"device": 320}),
        Outcome(kind="chat", replica=1, started=1003.0, ended=1005.0, prompt_tokens=400,
                tiers={"disk": 128, "redis": 192}),
        Outcome(kind="pin", replica=1, started=1004.0, ended=1004.5),
        Outcome(kind="chat", replica=0, started=1020.0, ended=1025.0, prompt_tokens=400),
    ]
    samples = [Sampled(at, process, ProcessSample(100 << 20, 14, 20) if at != 10.0 or
                       process == "redis" else ProcessSample(None, None, None))
               for at in (0.0, 5.0, 10.0, 15.0, 20.0) for process in ("replica-0", "redis")]
    windows = [FaultWindow(kind="redis_kill_restart", started=1008.0, ended=1010.0,
                           note="killed")]
    return SoakReport(outcomes=outcomes, windows=windows, samples=samples, started=1000.0,
                      warmup_s=5.0)


def test_tier_shares_are_per_bin_of_the_checked_answers_prompt_tokens() -> None:
    starts, shares = hit_shares(_report(), bin_s=10.0)
    assert starts == [0.0, 10.0, 20.0]
    assert shares == {"device": [320 / 800, 0.0, 0.0], "disk": [128 / 800, 0.0, 0.0],
                      "redis": [192 / 800, 0.0, 0.0]}


def test_the_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "soak.png"
    out = io.StringIO()
    assert plot_soak(_report(), path, out)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {path}" in out.getvalue()
