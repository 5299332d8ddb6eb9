"""``kvgate bench ttft --spawn`` end to end at tiny scale: the real CLI, a real ``kvgate serve``
subprocess (and a real redis-server when one is installed), the tiny Llama, 16-token blocks.

Speed is never asserted -- only that every row is there, with positive figures, and that each
warm row was served from the tier it forces (as the responses' usage reports it).
"""

from __future__ import annotations

import io
import os
import re
import shutil
from pathlib import Path

import pytest

from gateway.bench.numerics import resolve_numerics
from gateway.bench.peers import hf_recipe_rows
from gateway.bench.plotting import plot_ttft
from gateway.bench.prompts import SuffixSource, make_prefix
from gateway.bench.rows import (
    COLD,
    DEVICE,
    HF_COLD,
    HF_WARM,
    LLAMA_RAM,
    LengthResult,
    Row,
    Sample,
)
from gateway.engine.models.loading import load_model
from tests.gateway.bench.cli_run import run_bench
from tests.tiny_llama import save_tiny_llama

LENGTHS = (32, 64)
BLOCK = 16
KVGATE_ROWS = {
    "kvgate cold (no_cache)": None,
    "kvgate warm: device": "device",
    "kvgate warm: host": "host",
    "kvgate warm: disk": "disk",
    "kvgate warm: redis": "redis",
}
HF_ROWS = ("HF recipe cold", "HF recipe warm (deepcopy)", "HF suffix only (cache ready)")
REFERENCE_ROWS = ("pinned -> device copy of prefix K/V",)
LLAMA_ROWS = ("llama.cpp cold", "llama.cpp RAM-cache warm", "llama.cpp disk-cache warm")
ON_EACH_DEVICE = pytest.mark.parametrize(("device", "dtype"), [
    ("cpu", "float32"), pytest.param("cuda", "bfloat16", marks=pytest.mark.gpu)])
_NUMBER = r"(-|[\d,]+\.\d)"
_ROW = re.compile(rf"^(?P<label>.+?)\s+{_NUMBER}\s+(?P<ratio>-|\d+\.\d+)\s+{_NUMBER}\s+"
                  r"(?P<cached>[\d/-]+)\s+(?P<served>.+)$")


def _tables(stdout: str) -> dict[int, dict[str, str]]:
    """Rows of each length's table: label -> the rest of the line."""
    tables: dict[int, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in stdout.splitlines():
        header = re.match(r"^prefix ([\d,]+) tokens \+ \d+-token suffix", line)
        if header:
            current = tables.setdefault(int(header.group(1).replace(",", "")), {})
            continue
        if current is not None and not line.strip():
            current = None
        if current is None or line.startswith(("row ", "---")):
            continue
        for label in (*KVGATE_ROWS, *HF_ROWS, *REFERENCE_ROWS, *LLAMA_ROWS):
            if line.startswith(label + " "):
                current[label] = line
    return tables


@pytest.mark.slow
def test_bench_ttft_spawn_prints_every_row_with_positive_figures(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    plot = tmp_path / "ttft.png"
    proc = run_bench(
        ["ttft", "--spawn", "--model", str(model_dir), "--data-dir", str(tmp_path / "data"),
         "--lengths", ",".join(map(str, LENGTHS)), "--block-tokens", str(BLOCK),
         "--suffix-tokens", "8", "--repeats", "2", "--no-peers", "--plot", str(plot)],
        timeout_s=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tables = _tables(proc.stdout)
    assert sorted(tables) == list(LENGTHS), proc.stdout
    has_redis = shutil.which("redis-server") is not None
    for length, rows in tables.items():
        assert set(rows) == {*KVGATE_ROWS, *HF_ROWS, *REFERENCE_ROWS, *LLAMA_ROWS}, proc.stdout
        for label in LLAMA_ROWS:
            assert "n/a (--no-peers)" in rows[label]
        for label, tier in KVGATE_ROWS.items():
            if tier == "redis" and not has_redis:
                assert "n/a (no redis-server on PATH" in rows[label]
                continue
            match = _ROW.match(rows[label])
            assert match is not None, rows[label]
            ttft_ms, server_ms = float(match.group(2).replace(",", "")), float(
                match.group(4).replace(",", ""))
            assert ttft_ms > 0 and server_ms > 0, rows[label]
            if tier is None:
                assert match.group("cached") == "0" and match.group("served") == "-"
            else:
                assert match.group("cached") == str(length), rows[label]
                assert match.group("served") == f"{tier}:{length}", rows[label]
                assert 0 < float(match.group("ratio")), rows[label]
        for label in HF_ROWS:
            fields = rows[label][len(label):].split()
            assert float(fields[0].replace(",", "")) > 0, rows[label]
        assert rows["HF recipe warm (deepcopy)"].split()[-3] == str(length)
        copy_row = rows["pinned -> device copy of prefix K/V"]
        if "on cpu in float32" in proc.stdout:
            assert "n/a (a GPU's host -> device copy" in copy_row, copy_row
        else:
            assert f"{length}" in copy_row and "MiB pinned" in copy_row, copy_row
    # the reference and the spawned gateway (as its Stats say) on one device, in one dtype
    assert re.search(r"2 layers, 2 KV heads x \d+\) on (cpu in float32|cuda:0 in bfloat16), "
                     r"spawned gateway on \1, blocks of", proc.stdout), proc.stdout[:600]
    assert "targets at 2,048 tokens" in proc.stdout
    assert "not measured: add 2048 to --lengths" in proc.stdout
    assert "spawned kvgate serve (pid" in proc.stderr
    assert plot.read_bytes().startswith(b"\x89PNG") and f"plot: {plot}" in proc.stdout


def test_the_ttft_chart_has_a_panel_per_length_and_leaves_out_rows_without_samples(
    tmp_path: Path,
) -> None:
    results = []
    for length, cold_s in ((512, 0.87), (2048, 4.06)):
        result = LengthResult(prefix_tokens=length)
        result.rows = [
            Row(label=COLD, system="kvgate", samples=[Sample(seconds=cold_s, cached_tokens=0,
                                                             served_from="-")]),
            Row(label=DEVICE, system="kvgate", tier="device",
                samples=[Sample(seconds=0.1, cached_tokens=length,
                                served_from=f"device:{length}")]),
            Row(label=HF_WARM, system="hf", samples=[Sample(seconds=0.12, cached_tokens=length,
                                                            served_from="DynamicCache copy")]),
            Row(label=LLAMA_RAM, system="llama.cpp", note="n/a (--no-peers)"),
        ]
        results.append(result)
    out = io.StringIO()
    assert plot_ttft(results, tmp_path / "ttft.png", out)
    assert (tmp_path / "ttft.png").read_bytes().startswith(b"\x89PNG")


@ON_EACH_DEVICE
def test_the_transformers_reference_runs_on_the_device_and_dtype_given(
    tmp_path: Path, device: str, dtype: str,
) -> None:
    numerics = resolve_numerics(device, dtype)
    loaded = load_model(str(save_tiny_llama(tmp_path / "tiny")), device=numerics.device,
                        dtype=numerics.dtype)
    assert loaded.model.get_input_embeddings().weight.dtype == numerics.dtype
    prefix = make_prefix(loaded, 32, "Reference")
    cold, warm, suffix_only, copy = hf_recipe_rows(loaded, prefix, SuffixSource(loaded, 8), 2,
                                                   io.StringIO(), numerics)
    assert (cold.label, warm.label) == (HF_COLD, HF_WARM)
    assert all(s.seconds > 0 for s in (*cold.samples, *warm.samples, *suffix_only.samples))
    assert [s.cached_tokens for s in warm.samples] == [32, 32]
    assert [s.cached_tokens for s in suffix_only.samples] == [32, 32]  # cropped back each time
    if device == "cuda":
        assert len(copy.samples) == 2 and all(s.seconds > 0 for s in copy.samples)
    else:
        assert copy.note is not None and copy.note.startswith("n/a") and not copy.samples
