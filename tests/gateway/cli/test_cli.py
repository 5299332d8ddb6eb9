"""The ``kvgate`` command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import pytest

from gateway.cli.main import build_parser, main, usage_line
from gateway.core.requests import Usage


def test_bench_index_prints_a_row_per_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "index", "--sizes", "700,1400", "--repeats", "20"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.strip().startswith(("700", "1,400"))]
    assert len(rows) == 2
    assert "lkp 2k p50/p99" in out


def test_the_console_script_is_installed_beside_python() -> None:
    script = Path(sys.executable).parent / "kvgate"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False)
    assert result.returncode == 0
    assert "bench" in result.stdout


def test_version_prints_the_installed_packages_version() -> None:
    script = Path(sys.executable).parent / "kvgate"
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"kvgate {metadata.version('kvgate')}\n"


def test_the_license_pyproject_names_is_at_the_root_in_full() -> None:
    root = Path(__file__).resolve().parents[3]
    pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    assert 'license = { text = "Apache-2.0" }' in pyproject
    text = (root / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202


def test_an_unknown_command_exits_with_usage() -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(["frobnicate"])
    assert excinfo.value.code == 2


def test_generate_takes_allow_lossy_as_a_flag_off_by_default() -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).allow_lossy is False
    assert parser.parse_args(["generate", "--allow-lossy", "hi"]).allow_lossy is True


def test_the_usage_line_says_lossy_yes_only_for_a_lossy_answer() -> None:
    exact = Usage(prompt_tokens=342, cached_tokens=320, cached_tokens_by_tier={"device": 320},
                  completion_tokens=48, ttft_ms=70.3, total_ms=1904.2, finish_reason="length")
    assert usage_line(exact) == (
        "prompt_tokens=342 cached_tokens=320 cached_by_tier=device:320 completion_tokens=48 "
        "ttft_ms=70.3 total_ms=1904.2 finish=length")
    lossy = replace(exact, cached_tokens=2048, cached_tokens_by_tier={"device": 128,
                    "disk:int8": 1920}, lossy=True)
    line = usage_line(lossy)
    assert line.endswith(" finish=length lossy=yes")
    assert "cached_by_tier=device:128,disk:int8:1920 " in line
