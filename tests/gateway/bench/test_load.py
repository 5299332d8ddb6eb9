"""``kvgate bench load`` end to end at tiny scale: the real CLI, real ``kvgate serve`` subprocesses
(one per configuration and user count), the tiny Llama, a short system prompt.

Speed is never asserted -- only that every row is there with sane figures: the number of
requests, p50 <= p99, a cached fraction in [0, 1] (0 for no_cache), a peak RSS; and that the
transformers serve rows say n/a, not crash, when the peers venv is missing. The workload and
the report are also checked alone.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
import torch

from gateway.bench.admission import measure_admission
from gateway.bench.chat_workload import Conversation, question, system_prompt
from gateway.bench.kv_held import read_gauge
from gateway.bench.load import LoadResult, kv_growth_lines, percentile, plot_results
from gateway.bench.peer_serve import StreamedReply
from gateway.bench.spawn import EngineOptions, process_tree_peak_rss, spawn_config
from gateway.config.loader import load_serve_config
from tests.gateway.bench.cli_run import run_bench
from tests.tiny_llama import save_tiny_llama
from tiers.payload import KVLayout

USERS = (1, 2)
ROUNDS = 1
KVGATE_CONFIGS = ("kvgate", "kvgate serial", "kvgate no_cache")
PEER = "transformers serve CB"
_ROW = re.compile(
    r"^(?P<label>kvgate(?: serial| no_cache| HTTP SSE)?)\s+(?P<users>\d+)\s+(?P<reqs>\d+)\s+"
    r"(?P<t50>[\d,]+)\s+(?P<t99>[\d,]+)\s+(?P<l50>[\d,]+)\s+(?P<l99>[\d,]+)\s+"
    r"(?P<rps>[\d.]+)\s+(?P<tps>[\d.]+)\s+(?P<cached>[\d.]+)\s+(?P<rss>[\d,]+) MiB\s+"
    r"(?P<held>[\d,]+) MiB\s+(?P<cores>[\d.]+)\s+route (?P<route>\w+)")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@pytest.mark.slow
def test_bench_load_prints_every_configuration_and_user_count(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    plot = tmp_path / "load.png"
    proc = run_bench(
        ["load", "--model", str(model_dir), "--data-dir", str(tmp_path / "data"),
         "--users", ",".join(map(str, USERS)), "--rounds", str(ROUNDS), "--max-tokens", "4",
         "--rules", "6", "--block-tokens", "16", "--plot", str(plot),
         "--peers-python", str(tmp_path / "no-peers-venv" / "bin" / "python")],
        timeout_s=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"every server on (cpu in float32|cuda:0 in bfloat16);", proc.stdout)
    rows = [m for m in map(_ROW.match, proc.stdout.splitlines()) if m is not None]
    assert [(m["label"], int(m["users"])) for m in rows] == [
        (label, n) for label in KVGATE_CONFIGS for n in USERS], proc.stdout
    for m in rows:
        assert int(m["reqs"]) == int(m["users"]) * ROUNDS, m.group(0)
        assert 0 < _number(m["t50"]) <= _number(m["t99"]), m.group(0)
        assert 0 < _number(m["l50"]) <= _number(m["l99"]), m.group(0)
        assert _number(m["t50"]) <= _number(m["l99"]), m.group(0)
        assert _number(m["rps"]) > 0 and _number(m["tps"]) > 0, m.group(0)
        assert 0.0 <= _number(m["cached"]) <= 1.0, m.group(0)
        assert _number(m["rss"]) > 0, m.group(0)
        assert _number(m["cores"]) >= 0, m.group(0)  # a diagnostic: only that it is read
        if m["label"] == "kvgate no_cache":
            assert _number(m["cached"]) == 0.0, m.group(0)
        if m["label"] == "kvgate serial":
            assert m["route"] == "serial", m.group(0)
    peer_rows = [line for line in proc.stdout.splitlines() if line.startswith(PEER)]
    assert len(peer_rows) == len(USERS), proc.stdout
    assert all("n/a (run make bench-peers)" in line for line in peer_rows), proc.stdout
    assert plot.is_file() and plot.read_bytes().startswith(b"\x89PNG")
    admission = re.search(r"admitting a warm turn with ([\d,]+) cached tokens .*: pages listed "
                          r"([\d.]+) ms, copied into the request's own ([\d.]+) ms", proc.stdout)
    assert admission is not None and _number(admission[1]) > 0, proc.stdout
    assert proc.stderr.count("spawned kvgate serve (pid") == len(KVGATE_CONFIGS) * len(USERS)


@pytest.mark.slow
def test_kvgate_over_http_streams_the_same_chat_load_through_its_openai_front(
        tmp_path: Path) -> None:
    """``--configs http``: the users stream server-sent events from kvgate's HTTP front (the
    client every peer gets), and the second round reads the first one's prefix."""
    model_dir = save_tiny_llama(tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    proc = run_bench(
        ["load", "--model", str(model_dir), "--data-dir", str(tmp_path / "data"),
         "--configs", "http", "--users", "1", "--rounds", "2", "--max-tokens", "4",
         "--rules", "6", "--block-tokens", "16", "--no-plot"], timeout_s=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [m for m in map(_ROW.match, proc.stdout.splitlines()) if m is not None]
    assert [(m["label"], int(m["users"]), int(m["reqs"])) for m in rows] == [
        ("kvgate HTTP SSE", 1, 2)], proc.stdout
    assert _number(rows[0]["cached"]) > 0, rows[0].group(0)


def test_users_share_the_system_prompt_and_nothing_after_it() -> None:
    system = system_prompt(60)
    assert system.count("\n") == 61 and "\n60. " in system and "\n61. " not in system
    assert system == system_prompt(60)  # deterministic
    a = Conversation(user=0, system=system, num_rules=60)
    b = Conversation(user=1, system=system, num_rules=60)
    first_a, first_b = a.next_messages(), b.next_messages()
    assert first_a[0] == first_b[0] == {"role": "system", "content": system}
    assert first_a[1] != first_b[1]
    a.answered("Rule 1 asks me to be plain.")
    second = a.next_messages()
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert second[2]["content"] == "Rule 1 asks me to be plain."
    assert second[3]["content"] == question(0, 1, 60)
    with pytest.raises(ValueError):
        system_prompt(0)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.0) == 1.0
    assert percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)


def test_engine_options_reach_the_spawned_configuration(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(
        block_tokens=64, device_bytes=1 << 20, redis_url=None,
        api_key="kvg-bench-Qm3xT8vLp2Zr9Kd4Wn7Y", admin_key="kvg-bench-admin-Hs5Jq1Bc6Vf0Rt3Ue8Ga",
        engine=EngineOptions(route="serial", max_running=20, max_running_per_tenant=20,
                             captured_steps=False)))
    engine = load_serve_config(path, env={}).engine
    assert (engine.route, engine.max_running, engine.max_running_per_tenant,
            engine.captured_steps) == ("serial", 20, 20, False)


def test_peak_rss_of_this_process_is_read_from_proc() -> None:
    rss = process_tree_peak_rss(os.getpid())
    assert rss is not None and rss > 10 << 20


def test_plot_is_a_png_with_one_line_per_configuration(tmp_path: Path) -> None:
    reply = StreamedReply(text="x", ttft_s=0.1, latency_s=0.2, prompt_tokens=10,
                          cached_tokens=5, completion_tokens=4)
    results = [LoadResult(label=label, num_users=n, replies=[reply] * n, wall_s=1.0)
               for label in ("a", "b") for n in (1, 4)]
    results.append(LoadResult(label="peer", num_users=1, note="n/a (run make bench-peers)"))
    out = io.StringIO()
    assert plot_results(results, tmp_path / "p.png", out)
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    assert results[0].cached_fraction == 0.5


def test_the_peak_kv_held_is_read_from_the_servers_gauge() -> None:
    exposition = ("# HELP kvgate_kv_bytes_in_use KV bytes ...\n"
                  "# TYPE kvgate_kv_bytes_in_use gauge\n"
                  "kvgate_kv_bytes_in_use 3.5e+06\nkvgate_kv_budget_bytes 2.0e+09\n")
    assert read_gauge(exposition) == 3.5e6
    assert read_gauge("kvgate_kv_budget_bytes 1\n") is None


def test_kv_growth_with_users_is_printed_as_bytes_and_as_distinct_tokens() -> None:
    results = [LoadResult(label="kvgate", num_users=1, peak_kv_bytes=100, peak_kv_tokens=1000),
               LoadResult(label="kvgate", num_users=8, peak_kv_bytes=180, peak_kv_tokens=1700),
               LoadResult(label="peer", num_users=1, note="n/a (run make bench-peers)"),
               LoadResult(label="alone", num_users=8, peak_kv_bytes=5, peak_kv_tokens=5)]
    assert kv_growth_lines(results) == [
        "kvgate: KV held against one user's (peak bytes; peak distinct tokens, 1,000 alone): "
        "8 users 1.80x bytes / 1.70x tokens"]


def test_admission_is_measured_both_ways_on_whole_blocks() -> None:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
    result = measure_admission(layout, cached_tokens=100, block_tokens=16, repeats=3)
    assert result.cached_tokens == 96  # whole blocks only
    assert result.listed_s > 0 and result.copied_s > 0
