"""Configuration a person got wrong ends in one line they can act on, not a traceback (issue 22):
deeply nested arrays, a file that is not UTF-8, and a data directory that is a file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.common import EXIT_FAILED, EXIT_USAGE
from gateway.config.loader import read_config_file
from gateway.config.secrets import ensure_private_dir
from gateway.config.settings import ConfigError

DEPTH = 100_000


def _deep(path: Path) -> Path:
    if path.suffix == ".toml":
        path.write_text("x = " + "[" * DEPTH + "]" * DEPTH + "\n", encoding="utf-8")
    else:
        path.write_text('{"x": ' + "[" * DEPTH + "]" * DEPTH + "}", encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["kvgate.toml", "kvgate.json"])
def test_deeply_nested_arrays_are_a_config_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="nests arrays or tables too deeply"):
        read_config_file(_deep(tmp_path / name))


def test_a_config_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_bytes(b"[server]\nhost = \"\xff\"\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_config_file(path)


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_data_dir_that_is_a_file_is_a_config_error(tmp_path: Path, under: str) -> None:
    (tmp_path / "data").write_text("not a directory")
    with pytest.raises(ConfigError, match="data directory .* (not a directory|Not a directory)"):
        ensure_private_dir(tmp_path / "data" / under)


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    kvgate = Path(sys.executable).parent / "kvgate"
    return subprocess.run([str(kvgate), "serve", "--model", "bundled", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_serve_prints_one_line_for_a_too_deep_config(tmp_path: Path) -> None:
    result = _serve("--config", str(_deep(tmp_path / "kvgate.toml")))
    assert result.returncode == EXIT_USAGE
    assert result.stderr.splitlines() == [
        f"kvgate serve: {tmp_path / 'kvgate.toml'} nests arrays or tables too deeply to parse; "
        "no kvgate setting nests more than a few levels: check the file for a run of '[' or '{'"]


def test_serve_prints_one_line_for_a_data_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "data").write_text("not a directory")
    result = _serve("--data-dir", str(tmp_path / "data"))
    assert result.returncode == EXIT_FAILED
    lines = [line for line in result.stderr.splitlines() if "Traceback" in line
             or line.startswith("kvgate serve:")]
    assert lines == [f"kvgate serve: the data directory {tmp_path / 'data'} exists but is not "
                     "a directory: move the file away or choose another ([server] data_dir, "
                     "--data-dir)"]
