"""The reference of ``kvgate bench load``: ``transformers serve --continuous-batching``.

transformers' own OpenAI-compatible server, run by the ``.venv-peers`` interpreter (``make
bench-peers`` installs ``transformers[serving]`` there, the same transformers version as
kvgate's) on the very checkpoint kvgate loads -- the GGUF's converted copy under
``DATA_DIR/models/converted/<fingerprint>/`` -- on a free loopback port, on the benchmark's
device in its dtype (``--device``, ``--dtype``: the same as the kvgate servers beside it), paged
KV blocks of ``--cb-block-size`` tokens. It is started as a subprocess and stopped by
pid. Requests go over HTTP (``/v1/chat/completions``, ``stream: true``, server-sent events)
with nothing but the standard library, so kvgate's own environment needs none of the peer's
packages.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gateway.bench.rows import BenchError
from gateway.bench.spawn import free_port, stop_process

PEERS_VENV = ".venv-peers"
PEER_BLOCK_TOKENS = 32
PEER_NUM_BLOCKS = 1024
"""32k tokens of paged KV (~1.4 GiB for SmolLM2 in float32), kvgate's default KV budget being
2 GiB: left to itself on a CPU, transformers sizes the pool from free memory (7 GiB here)."""
PEER_BATCH_TOKENS = 256
"""Tokens per batch, as kvgate's default ``step_tokens``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerServer:
    """A running ``transformers serve``."""

    host: str
    port: int
    pid: int
    version: str


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamedReply:
    """What a client saw of one streamed chat completion."""

    text: str
    ttft_s: float
    latency_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int
    cached_by_tier: dict[str, int] | None = None
    """kvgate's ``usage.kvgate.cached_tokens_by_tier`` over HTTP (None where not reported)."""
    user: int | None = None
    """Which user of a load asked (``gateway.bench.load_clients.run_users``), and in which round."""
    round_index: int | None = None


def serve_binary(explicit: Path | None = None) -> tuple[Path | None, str]:
    """The ``transformers`` command of the peers venv, or None and why not."""
    python = explicit if explicit is not None else (
        Path(__file__).resolve().parents[2] / PEERS_VENV / "bin" / "python")
    if not python.is_file():
        return None, "n/a (run make bench-peers)"
    probe = subprocess.run(
        [str(python), "-c",
         "import fastapi, uvicorn, transformers; print(transformers.__version__)"],
        capture_output=True, text=True, timeout=120, check=False)
    if probe.returncode != 0:
        return None, "n/a (run make bench-peers: transformers[serving] does not import)"
    return python, probe.stdout.strip()


def serve_command(python: Path, model_dir: Path, *, port: int, device: str,
                  dtype: str) -> list[str]:
    """The ``transformers serve --continuous-batching`` command line of the reference, on
    127.0.0.1:``port``, its model on ``device`` in ``dtype``."""
    return [str(python.parent / "transformers"), "serve", str(model_dir.resolve()),
            "--continuous-batching", "--cb-block-size", str(PEER_BLOCK_TOKENS),
            "--cb-num-blocks", str(PEER_NUM_BLOCKS),
            "--cb-max-batch-tokens", str(PEER_BATCH_TOKENS),
            "--device", device, "--dtype", dtype, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]


@contextmanager
def spawn_transformers_serve(python: Path, model_dir: Path, *, version: str, err: TextIO,
                             device: str, dtype: str, threads: int | None = None,
                             start_timeout_s: float = 600.0) -> Iterator[PeerServer]:
    """``transformers serve MODEL_DIR --continuous-batching`` on a free loopback port (on
    ``device`` in ``dtype``, spelled as ``kvgate serve`` resolves them: ``cpu``/``cuda:0``,
    ``float32``/``bfloat16``; ``PEER_NUM_BLOCKS`` pages of ``PEER_BLOCK_TOKENS`` tokens, batches
    of at most ``PEER_BATCH_TOKENS``), ready when ``/health`` answers; stopped by pid.

    Raises:
        BenchError: the server exited or did not answer within ``start_timeout_s``.
    """
    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="kvgate-bench-load-peer-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "HF_HUB_"))}
    env["HF_HUB_OFFLINE"] = "1"
    env["HF_HOME"] = str(scratch / "hf")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    log = scratch / "serve.log"
    command = serve_command(python, model_dir, port=port, device=device, dtype=dtype)
    try:
        with log.open("wb") as log_fh:
            proc = subprocess.Popen(command, stdout=log_fh, stderr=subprocess.STDOUT, env=env,
                                    cwd=scratch)
        try:
            wait_healthy(proc, port, log, start_timeout_s, server="transformers serve")
            err.write(f"[load] spawned transformers serve {version} (pid {proc.pid}) on "
                      f"127.0.0.1:{port}, {device} in {dtype}\n")
            yield PeerServer(host="127.0.0.1", port=port, pid=proc.pid, version=version)
        finally:
            stop_process(proc, grace_s=15)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def wait_healthy(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float, *,
                 server: str) -> None:
    """Returns once ``GET /health`` on 127.0.0.1:``port`` answers 200.

    Raises:
        BenchError: ``proc`` exited first, or ``timeout_s`` passed; with the tail of ``log``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{server} exited with status {proc.returncode}:\n"
                             + log.read_text(encoding="utf-8", errors="replace")[-2000:])
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        except OSError:
            pass
        time.sleep(0.2)
    raise BenchError(f"{server} did not answer within {timeout_s:.0f} s:\n"
                     + log.read_text(encoding="utf-8", errors="replace")[-2000:])


class Unanswered(BenchError):
    """No model saw the request, as far as the client can tell: the connection was refused, or
    closed (a kept-alive one the server had let go) before the status line, or the server
    routed it nowhere (503; a router's 404 ``model_not_found`` while its workers register, as
    SMG answers in the moment after it starts listening). Nothing was streamed."""


def stream_chat(conn: http.client.HTTPConnection, messages: Sequence[dict[str, str]], *,
                max_tokens: int, headers: Mapping[str, str] | None = None,
                server: str = "transformers serve", model: str | None = None,
                extra_body: Mapping[str, Any] | None = None) -> StreamedReply:
    """One greedy ``/v1/chat/completions`` with ``stream: true``, timed from sending the
    request to the first chunk that carries text. ``extra_body``: fields of a server's own
    beside OpenAI's (vLLM's ``ignore_eos``).

    Raises:
        Unanswered: no byte of an answer came.
        BenchError: the server answered with an error or the stream had no text.
    """
    request: dict[str, Any] = {"messages": list(messages), "max_tokens": max_tokens,
                               "temperature": 0.0, "stream": True,
                               "stream_options": {"include_usage": True}}
    if model is not None:  # a router picks workers by it
        request["model"] = model
    request.update(extra_body or {})
    body = json.dumps(request)
    began = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", body=body,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                              **(headers or {})})
        response = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        raise Unanswered(f"{server} answered nothing ({type(exc).__name__}: {exc})") from exc
    if response.status != 200:
        detail = response.read()[:500]
        if response.status == 503 or (response.status == 404 and b"model_not_found" in detail):
            raise Unanswered(f"{server} routed it nowhere ({response.status}: {detail!r})")
        raise BenchError(f"{server} answered {response.status}: {detail!r}")
    first: float | None = None
    parts: list[str] = []
    num_chunks = 0
    usage: dict[str, Any] | None = None
    while True:
        line = response.readline()
        if not line:
            break
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            raise BenchError(f"{server}: {chunk['error']}")
        for choice in chunk.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                if first is None:
                    first = time.perf_counter() - began
                parts.append(text)
                num_chunks += 1
        if chunk.get("usage"):
            usage = chunk["usage"]
    latency = time.perf_counter() - began
    response.read()
    if first is None:
        raise BenchError(f"{server} streamed no text")
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    by_tier = ((usage or {}).get("kvgate") or {}).get("cached_tokens_by_tier")
    return StreamedReply(
        text="".join(parts), ttft_s=first, latency_s=latency,
        prompt_tokens=int(usage["prompt_tokens"]) if usage else None,
        cached_tokens=int(cached) if cached is not None else None,
        completion_tokens=int(usage["completion_tokens"]) if usage else num_chunks,
        cached_by_tier=({str(k): int(v) for k, v in by_tier.items()}
                        if isinstance(by_tier, dict) else None),
    )
