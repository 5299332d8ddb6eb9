"""A gateway (and a Redis) of a benchmark's own: ``kvgate bench ttft --spawn``, ``bench load``.

Starts ``kvgate serve`` as a subprocess -- the same command an operator runs -- on free loopback
ports with a temporary data directory and keys of its own, plus a throwaway ``redis-server``
when one is on PATH, and stops them by pid. ``Endpoint`` names the gateway a run measures,
spawned or given.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gateway.bench.process_tree import process_tree_pids
from gateway.bench.rows import BenchError
from gateway.cache.operations.factory import CacheConfig
from gateway.config.limits import LimitSettings

SPAWN_TENANT = "bench"

_SERVING = re.compile(r"SERVING kvgate\.v1 on 127\.0\.0\.1:(\d+)")
_ROUTE = re.compile(r"engine route (\w+): (.*)\)$", re.MULTILINE)
_HTTP = re.compile(r"SERVING kvgate\.v1 on \S+ and the OpenAI API on https?://\S+:(\d+)/v1")


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """A gateway to measure, and what the benchmark may do to it."""

    host: str
    port: int
    api_key: str | None
    admin_key: str | None
    tenant: str
    why_no_redis: str | None = None
    pid: int | None = None
    """The spawned server's process id (None for a gateway the benchmark did not start)."""
    route: str | None = None
    """The engine route the spawned server's start line names (``batched``/``serial``)."""
    http_port: int | None = None
    """The spawned server's OpenAI-compatible HTTP port (``/metrics`` too), from its start
    line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """``[engine]`` settings of a spawned gateway; None leaves the server's default."""

    route: str | None = None
    max_running: int | None = None
    max_running_per_tenant: int | None = None
    max_queued_per_tenant: int | None = None
    shadow_fraction: float | None = None
    captured_steps: bool | None = None

    def toml_lines(self) -> list[str]:
        values = {"route": self.route, "max_running": self.max_running,
                  "max_running_per_tenant": self.max_running_per_tenant,
                  "max_queued_per_tenant": self.max_queued_per_tenant,
                  "shadow_fraction": self.shadow_fraction,
                  "captured_steps": self.captured_steps}
        lines = [f"{name} = {_toml_value(value)}" for name, value in values.items()
                 if value is not None]
        return ["", "[engine]", *lines] if lines else []



def _toml_value(value: object) -> str:
    """``value`` as TOML writes it (a bool is ``true``/``false``, not Python's ``True``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    return f'"{value}"'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def stop_process(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM by pid, then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM to the process group ``proc`` leads (started with ``start_new_session=True``),
    then SIGKILL to what is left of it once ``proc`` has exited or ``grace_s`` has passed.

    For a server that forks workers of its own (vLLM's engine core): stopping the leader alone
    can leave them running, holding memory and cores after the bench moved on.
    """
    def signal_group(signum: int) -> None:
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass  # the whole group is gone already

    if proc.poll() is None:
        signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):  # the SIGKILL below ends it
            proc.wait(timeout=grace_s)
    signal_group(signal.SIGKILL)
    proc.wait(timeout=10)


@contextmanager
def redis_on_loopback(binary: str, workdir: Path) -> Iterator[str]:
    """A throwaway ``redis-server`` (no persistence) on a free loopback port; yields its URL."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                raise BenchError(f"{binary} exited with status {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"{binary} did not answer on 127.0.0.1:{port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(proc, grace_s=10)


def spawn_config(*, block_tokens: int, device_bytes: int, redis_url: str | None,
                 api_key: str, admin_key: str, engine: EngineOptions | None = None,
                 device: str = "auto", dtype: str = "auto", skip_slow_tiers: bool = True,
                 other_tenant_keys: Mapping[str, str] | None = None,
                 calls_per_key: int | None = None, host_bytes: str = "4GiB",
                 disk_bytes: str = "8GiB", redis_timeout_s: float = 10.0,
                 redis_cluster: bool = False) -> str:
    """The ``kvgate serve`` configuration of a spawned gateway (TOML); ``device`` and ``dtype``
    as ``--device`` and ``--dtype`` spell them (the benchmark's own, resolved);
    ``skip_slow_tiers`` False makes every load come from the tier that holds the block;
    ``other_tenant_keys`` (tenant -> key) are keys of other tenants beside the benchmark's own
    (a router's, which it registers workers with); ``calls_per_key``: the calls the benchmark's
    one key has in flight at most (its users), where that is more than the server's default
    ``[limits] max_calls_per_key``, which would refuse the users past it; ``redis_cluster``:
    ``redis_url`` names a node of a Redis Cluster."""
    lines = [
        "[server]",
        f'device = "{device}"',
        f'dtype = "{dtype}"',
        "",
        "[grpc]",
        "shutdown_grace_s = 5.0",
        "",
        "[http]",  # a free port: spawned gateways must not contend for the default one
        "port = 0",
        "",
        *(engine.toml_lines() if engine is not None else []),
        "",
        *_limits_lines(calls_per_key),
        "[cache]",
        f"block_tokens = {block_tokens}",
        f"device_bytes = {device_bytes}",
        f'host_bytes = "{host_bytes}"',
        f'disk_bytes = "{disk_bytes}"',
    ]
    # Keys left at the server's default are not written, so that a --baseline checkout of an
    # earlier commit, which may not know them, reads the same file.
    if 2 * device_bytes > CacheConfig().write_queue_bytes:
        # Room for the longest prefix and the filler that pushes it out, queued at once: a
        # smaller queue writes only the head of an 8B model's 8k-token chain to disk and Redis.
        lines.append(f"write_queue_bytes = {2 * device_bytes}")
    if not skip_slow_tiers:
        lines.append("skip_slow_tiers = false")
    if redis_url is not None:
        # Loopback Redis moving a whole 4,096-token prefix (~190 MB) in one pipeline: give each
        # socket read more than the 0.25 s default meant to bound a stalled remote Redis.
        lines += [f'redis_url = "{redis_url}"', f"redis_timeout_s = {redis_timeout_s}"]
        if redis_cluster:
            lines.append("redis_cluster = true")
    lines += [
        "",
        "[[api_keys]]",
        f'tenant = "{SPAWN_TENANT}"',
        f'key = "{api_key}"',
        "",
    ]
    for tenant, key in (other_tenant_keys or {}).items():
        lines += ["[[api_keys]]", f'tenant = "{tenant}"', f'key = "{key}"', ""]
    lines += [
        "[[admin_keys]]",
        'name = "bench-admin"',
        f'key = "{admin_key}"',
        "",
    ]
    return "\n".join(lines)


def _limits_lines(calls_per_key: int | None) -> list[str]:
    """``[limits]`` for a benchmark whose one key has ``calls_per_key`` calls in flight; none
    where the server's defaults admit them (a --baseline checkout reads the same file)."""
    defaults = LimitSettings()
    if calls_per_key is None or calls_per_key <= defaults.max_calls_per_key:
        return []
    return ["[limits]", f"max_calls_per_key = {calls_per_key}",
            f"max_calls = {max(defaults.max_calls, calls_per_key + defaults.max_lookups + 1)}",
            ""]


@contextmanager
def spawn_gateway(*, model: str, models_dir: Path, block_tokens: int, device_bytes: int,
                  redis_url: str | None, redis_binary: str | None, err: TextIO,
                  start_timeout_s: float = 600.0, engine: EngineOptions | None = None,
                  label: str = "ttft", device: str = "auto",
                  dtype: str = "auto", source: Path | None = None,
                  skip_slow_tiers: bool = True, api_key: str | None = None,
                  deployment_secret: str | None = None,
                  other_tenant_keys: Mapping[str, str] | None = None,
                  calls_per_key: int | None = None) -> Iterator[Endpoint]:
    """``kvgate serve`` (and a ``redis-server``) on free loopback ports, with a temporary data
    directory whose ``models`` is ``models_dir`` (no second GGUF conversion); stopped by pid.
    ``label`` names the benchmark in progress lines and the temporary directory; the server runs
    its model on ``device`` in ``dtype`` (``[server] device`` and ``dtype``). ``source``: a
    checkout of another kvgate commit whose ``gateway`` package the server runs instead of this
    one (first on its ``PYTHONPATH``), to measure two versions side by side. Replicas of one
    cluster share the tenant's ``api_key`` and the ``deployment_secret`` (hex), so that each
    reads the blocks the others wrote to their Redis; by default both are the server's own.
    ``other_tenant_keys`` and ``calls_per_key``: as ``spawn_config``'s.
    """
    root = Path(tempfile.mkdtemp(prefix=f"kvgate-bench-{label}-"))
    try:
        with _maybe_redis(redis_url, redis_binary, root / "redis") as (url, why_no_redis):
            data_dir = root / "data"
            data_dir.mkdir(mode=0o700)
            models_dir.mkdir(parents=True, exist_ok=True)
            (data_dir / "models").symlink_to(models_dir.resolve(), target_is_directory=True)
            api_key = api_key or "kvg-bench-" + secrets.token_urlsafe(24)
            admin_key = "kvg-bench-admin-" + secrets.token_urlsafe(24)
            config = root / "kvgate.toml"
            config.write_text(spawn_config(block_tokens=block_tokens, device_bytes=device_bytes,
                                           redis_url=url, api_key=api_key, admin_key=admin_key,
                                           engine=engine, device=device, dtype=dtype,
                                           skip_slow_tiers=skip_slow_tiers,
                                           other_tenant_keys=other_tenant_keys,
                                           calls_per_key=calls_per_key),
                              encoding="utf-8")
            config.chmod(0o600)
            model_arg = model if model == "bundled" else str(Path(model).expanduser().resolve())
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
            if deployment_secret is not None:
                env["KVGATE_DEPLOYMENT_SECRET"] = deployment_secret
            if source is not None:
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (str(source.resolve()), env.get("PYTHONPATH")) if p)
            log = root / "serve.log"
            with log.open("wb") as log_fh:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "gateway.cli.main", "serve", "--config", str(config),
                     "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir),
                     "--model", model_arg],
                    stdout=subprocess.DEVNULL, stderr=log_fh, env=env,
                    # ``-m`` puts the working directory first on sys.path: the source's own.
                    cwd=None if source is None else str(source.resolve()),
                )
            try:
                port, route, http_port = wait_serving(proc, log, start_timeout_s)
                err.write(f"[{label}] spawned kvgate serve (pid {proc.pid}) on 127.0.0.1:{port}"
                          f"{', redis ' + url if url else ''}\n")
                yield Endpoint(host="127.0.0.1", port=port, api_key=api_key,
                               admin_key=admin_key, tenant=SPAWN_TENANT,
                               why_no_redis=why_no_redis, pid=proc.pid, route=route,
                               http_port=http_port)
            finally:
                stop_process(proc, grace_s=30)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def _maybe_redis(url: str | None, binary: str | None,
                 workdir: Path) -> Iterator[tuple[str | None, str | None]]:
    if url is not None:
        yield url, None
        return
    if binary is None:
        yield None, "no redis-server on PATH and no --redis-url"
        return
    with redis_on_loopback(binary, workdir) as started:
        yield started, None


def wait_serving(proc: subprocess.Popen[bytes], log: Path, timeout_s: float, *,
                 offset: int = 0) -> tuple[int, str | None, int | None]:
    """The port the start line names, the engine route with why (None if unnamed), and the
    HTTP API's port (None if it names none); ``offset``: where in ``log`` this start's lines
    begin (a restarted server appends to the same log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with log.open("rb") as fh:
            fh.seek(max(0, offset))
            text = fh.read().decode("utf-8", errors="replace")
        match = _SERVING.search(text)
        if match:
            route = _ROUTE.search(text)
            http = _HTTP.search(text)
            return (int(match.group(1)),
                    f"{route.group(1)} ({route.group(2)})" if route else None,
                    int(http.group(1)) if http else None)
        if proc.poll() is not None:
            raise BenchError(f"kvgate serve exited with status {proc.returncode}:\n"
                             + text[-2000:])
        time.sleep(0.1)
    raise BenchError(f"kvgate serve did not start within {timeout_s:.0f} s:\n"
                     + log.read_text(encoding="utf-8", errors="replace")[-2000:])


def process_tree_peak_rss(pid: int) -> int | None:
    """Peak resident memory (``VmHWM``) of ``pid`` plus that of each of its live descendants, in
    bytes; None where /proc cannot tell (not Linux, or the process is gone).

    NOTE: a sum of per-process peaks, which may not all have happened at once: an upper bound
    of the tree's peak, exact for a single process (kvgate serve, transformers serve).
    """
    total, found = 0, False
    for current in process_tree_pids(pid):
        try:
            with open(f"/proc/{current}/status", encoding="ascii", errors="replace") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
                        found = True
                        break
        except OSError:
            continue
    return total if found else None
