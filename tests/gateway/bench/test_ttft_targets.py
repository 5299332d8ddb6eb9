"""The targets kvgate bench ttft prints: the CPU's at 2,048 tokens, the GPU issue's at 8,192,
each PASS or MISS against references from the same run, or n/a saying why."""

from __future__ import annotations

import io

from gateway.bench.rows import (
    COLD,
    DEVICE,
    DISK,
    HF_COLD,
    HF_SUFFIX,
    HOST,
    PINNED_COPY,
    REDIS,
    LengthResult,
    Row,
    Sample,
)
from gateway.bench.ttft_targets import print_targets


def row(label: str, ms: float, *, tier: str | None = None, served: str | None = None,
        cached: int = 8192) -> Row:
    """A row of one sample; a kvgate warm row is served from its ``tier`` unless ``served``
    says otherwise."""
    served_from = served if served is not None else (f"{tier}:{cached}" if tier else "-")
    sample = Sample(seconds=ms / 1e3, cached_tokens=0 if served_from == "-" else cached,
                    served_from=served_from)
    return Row(label=label, system="kvgate" if label.startswith("kvgate") else "hf",
               tier=tier, samples=[sample])


def h100_run() -> LengthResult:
    """The H100's 8B figures of 2026-11-27 (docs/gpu.md): disk and Redis recomputed."""
    return LengthResult(prefix_tokens=8192, rows=[
        row(COLD, 334.0), row(DEVICE, 29.7, tier="device"), row(HOST, 82.5, tier="host"),
        row(DISK, 374.4, tier="disk", served="-"), row(REDIS, 380.1, tier="redis", served="-"),
        row(HF_COLD, 260.8), row(HF_SUFFIX, 32.6), row(PINNED_COPY, 20.4)])


def test_on_a_gpu_the_issue_targets_are_judged_at_8k_against_the_same_runs_references() -> None:
    out = io.StringIO()
    verdicts = print_targets([h100_run()], out, on_gpu=True)
    assert verdicts == {
        "cold <= 1.25x HF one-shot prefill": "MISS",  # 334.0 > 326.0
        "warm device <= 1.15x HF suffix only": "PASS",  # 29.7 <= 37.5
        "warm host <= 1.2x (pinned copy + suffix)": "MISS",  # 82.5 > 63.6
        "disk row never slower than cold": "MISS",
        "redis row never slower than cold": "MISS",
    }
    assert "targets at 8,192 tokens" in out.getvalue()
    assert "82.5 ms vs 63.6 ms" in out.getvalue()


def test_a_disk_row_that_recomputed_counts_for_never_slower_than_cold() -> None:
    run = h100_run()
    run.rows[3] = row(DISK, 320.0, tier="disk", served="-")  # recomputed, faster than cold
    assert print_targets([run], io.StringIO(), on_gpu=True)[
        "disk row never slower than cold"] == "PASS"


def test_a_host_row_served_from_elsewhere_is_not_judged_as_the_host_tier() -> None:
    run = h100_run()
    run.rows[2] = row(HOST, 40.0, tier="host", served="device:8192")
    out = io.StringIO()
    verdicts = print_targets([run], out, on_gpu=True)
    assert verdicts["warm host <= 1.2x (pinned copy + suffix)"] == "n/a"
    assert "served from device:8192, not host" in out.getvalue()


def test_a_reference_not_measured_makes_its_target_n_a_naming_it() -> None:
    run = h100_run()
    run.rows = [r for r in run.rows if r.label != PINNED_COPY]
    out = io.StringIO()
    assert print_targets([run], out, on_gpu=True)[
        "warm host <= 1.2x (pinned copy + suffix)"] == "n/a"
    assert f"{PINNED_COPY}: not measured" in out.getvalue()


def test_without_the_targets_length_nothing_is_judged_and_the_output_says_which_to_add() -> None:
    out = io.StringIO()
    assert print_targets([LengthResult(prefix_tokens=2048)], out, on_gpu=True) == {}
    assert "not measured: add 8192 to --lengths" in out.getvalue()


def test_on_a_cpu_the_targets_are_the_cpus_at_2k() -> None:
    run = LengthResult(prefix_tokens=2048, rows=[
        row(COLD, 1000.0, cached=0), row(DEVICE, 40.0, tier="device", cached=2048)])
    verdicts = print_targets([run], io.StringIO())
    assert verdicts["warm device <= 5% of cold"] == "PASS"
    assert verdicts["warm disk <= 10% of cold"] == "n/a"
