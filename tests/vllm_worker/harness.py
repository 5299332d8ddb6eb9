"""Running vLLM with kvgate's connector from the tests: a worker's kvgate.toml, and one life of
a vLLM engine in vLLM's own venv (``life.py``), stopped by its process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.vllm_worker.life import RESULT_PREFIX

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON_ENV = "KVGATE_VLLM_PYTHON"
"""The python of vLLM's venv (``make test-vllm`` sets it); unset, the vLLM tests skip."""
SECRET_HEX = bytes(range(40, 72)).hex()
LIFE_TIMEOUT_S = 300.0


def write_worker_config(directory: Path, *, block_tokens: int, extra_cache: str = "",
                        extra_tiers: str = "") -> Path:
    """A vLLM worker's kvgate.toml in ``directory``: a device tier and a disk tier of its own
    (``directory/kv``)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "kvgate.toml"
    path.write_text(f"""
[server]
data_dir = "{directory / 'data'}"

[cache]
block_tokens = {block_tokens}
measure_at_start = false
{extra_cache}

[[cache.tier]]
kind = "device"
bytes = "8MiB"

[[cache.tier]]
kind = "disk"
bytes = "64MiB"
path = "{directory / 'kv'}"
fsync = false
{extra_tiers}
""")
    return path


@dataclass(frozen=True, slots=True)
class Answer:
    """One request's result in a life."""

    tokens: list[int]
    prompt: list[int]
    connector: dict[str, Any] | None
    cached: int
    seconds: float

    @property
    def loaded_tokens(self) -> int:
        return int((self.connector or {}).get("kvgate.loaded_tokens", 0))

    @property
    def failed_blocks(self) -> int:
        return int((self.connector or {}).get("kvgate.failed_blocks", 0))


def _environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "KVGATE_DEPLOYMENT_SECRET": SECRET_HEX, **(extra or {})}


def vllm_python() -> str | None:
    return os.environ.get(VLLM_PYTHON_ENV) or None


def live(job: dict[str, Any], *, env: dict[str, str] | None = None,
         timeout_s: float = LIFE_TIMEOUT_S) -> list[Answer]:
    """Run one life of vLLM on ``job`` (``life.py``'s input) and return its answers.

    Raises:
        AssertionError: the life failed (its output's tail in the message) or timed out.
    """
    returncode, output = _run(job, env=env, timeout_s=timeout_s)
    answers = [Answer(**json.loads(line[len(RESULT_PREFIX):]))
               for line in output.splitlines() if line.startswith(RESULT_PREFIX)]
    if returncode != 0 or len(answers) != len(job["requests"]):
        sys.stderr.write(output[-20000:])
        raise AssertionError(f"vLLM's life failed (exit {returncode}): {output[-3000:]}")
    return answers


def failed_life(job: dict[str, Any], *, timeout_s: float = LIFE_TIMEOUT_S) -> str:
    """Run a life of vLLM that must fail to start; return its output.

    Raises:
        AssertionError: it started and answered.
    """
    returncode, output = _run(job, env=None, timeout_s=timeout_s)
    assert returncode != 0 and RESULT_PREFIX not in output, "vLLM started and answered"
    return output


def _run(job: dict[str, Any], *, env: dict[str, str] | None, timeout_s: float
         ) -> tuple[int, str]:
    python = vllm_python()
    assert python is not None, f"{VLLM_PYTHON_ENV} is not set"
    environment = _environment(env)
    process = subprocess.Popen(
        [python, "-m", "tests.vllm_worker.life"], cwd=REPO, env=environment,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        output, _ = process.communicate(json.dumps(job), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise AssertionError(f"vLLM's life did not end in {timeout_s:.0f} s") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, output


@contextmanager
def api_server(model: str, config: Path, *, port: int, block_size: int,
               default_scope: str = "none", start_timeout_s: float = LIFE_TIMEOUT_S
               ) -> Iterator[str]:
    """vLLM's OpenAI-compatible server with kvgate's connector on 127.0.0.1:``port``, as the
    docs start it (docs/vllm-worker.md, "Running it"); yields its base URL and stops its
    process group on leaving."""
    python = vllm_python()
    assert python is not None, f"{VLLM_PYTHON_ENV} is not set"
    transfer = {"kv_connector": "KvgateConnector",
                "kv_connector_module_path": "gateway.vllm_connector.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvgate_config": str(config),
                                              "default_scope": default_scope}}
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--dtype", "float32", "--block-size", str(block_size),
               "--no-enable-prefix-caching", "--enforce-eager", "--max-model-len", "1024",
               "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config",
               json.dumps(transfer), "--host", "127.0.0.1", "--port", str(port)]
    log = config.parent / "vllm-server.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=_environment(), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"vLLM's server exited ({process.returncode}): "
                                     f"{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise AssertionError("vLLM's server did not answer /health in "
                                         f"{start_timeout_s:.0f} s") from None
                time.sleep(0.5)
        yield base
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def complete(base: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to the server's ``/v1/completions``; its JSON answer."""
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer
