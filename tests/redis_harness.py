"""Real Redis servers and a fault-injecting TCP proxy for tests (docs/reliability.md, group C).

* ``RedisServer``: Debian's ``redis-server`` on a free loopback port in its own directory,
  started and stopped by pid (SIGTERM, then SIGKILL), killable and restartable on the same
  port and directory; variants with ``requirepass``, ``maxmemory`` + policy, AOF or RDB.
* ``RedisCluster``: three masters (no replicas) joined with ``redis-cli --cluster create``.
* ``FaultProxy``: an asyncio TCP proxy on its own thread between a client and Redis whose
  mode can change at runtime: pass, delay(ms), blackhole, reset_after(n bytes), trickle(B/s),
  refuse.

Everything here is started by the test (or fixture) that uses it and stopped by it; nothing
outlives a test session. The fixtures live in ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
HOST = "127.0.0.1"


REDIS_PACKAGES = {"redis-server": "redis-server", "redis-cli": "redis-tools"}
"""The Debian package of each binary the Redis tests run."""


def redis_server_missing() -> str | None:
    """Why the Redis tests cannot run here (naming each missing binary and how to install
    it), or None when they can."""
    missing = [name for name, path in (("redis-server", REDIS_SERVER), ("redis-cli", REDIS_CLI))
               if not os.access(path, os.X_OK)]
    if not missing:
        return None
    packages = " ".join(dict.fromkeys(REDIS_PACKAGES[name] for name in missing))
    return (f"{' and '.join(missing)} not found on PATH: install Debian's {packages} "
            f"(`sudo apt-get install -y {packages}`, or `make redis-server`)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to 0, read, release)."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago: all bound at once
    before any is released, so that no two are the same port (one at a time, the system may
    hand a released port out again: a cluster's node then met its neighbour's bus port)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(count)]
        for sock in socks:
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


# ---------------------------------------------------------------------------------- RESP


class RespError(Exception):
    """An error reply (``-ERR ...``) from Redis to a harness command."""


def resp_command(
    port: int,
    *args: str | bytes | int,
    password: str | None = None,
    timeout_s: float = 2.0,
) -> object:
    """Send one command on a fresh connection and return the reply (no redis-py involved, so
    it works while a server is loading, refusing auth, or half set up).

    Replies: simple strings and bulk strings as ``bytes``, integers as ``int``, nil as None,
    arrays as lists. Error replies raise ``RespError``.
    """
    with socket.create_connection((HOST, port), timeout=timeout_s) as sock:
        reader = sock.makefile("rb")
        try:
            if password is not None:
                sock.sendall(_pack("AUTH", password))
                _read_reply(reader)
            sock.sendall(_pack(*args))
            return _read_reply(reader)
        finally:
            reader.close()


def _pack(*args: str | bytes | int) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _read_reply(reader: IO[bytes]) -> object:
    line = reader.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed mid-reply")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest
    if kind == b"-":
        raise RespError(rest.decode(errors="replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        data = reader.read(size + 2)
        return data[:-2]
    if kind == b"*":
        return [_read_reply(reader) for _ in range(int(rest))]
    raise ConnectionError(f"unexpected RESP reply {line[:40]!r}")


# ------------------------------------------------------------------------------ servers


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, owned by the test that started it.

    Args:
        workdir: its directory (``--dir``): RDB/AOF files, ``redis.log``; created if absent.
        port: default a free one; kept across ``restart()``.
        password: ``requirepass``.
        maxmemory: e.g. ``"2mb"``; with ``maxmemory_policy`` (e.g. ``"allkeys-lru"``).
        appendonly: AOF on (``appendfsync always``) so data survives a restart or a kill.
        save: RDB snapshot rule (e.g. ``"3600 1"``; a clean SIGTERM also writes it), or None.
        extra_args: more ``--name value`` arguments.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        password: str | None = None,
        maxmemory: str | None = None,
        maxmemory_policy: str | None = None,
        appendonly: bool = False,
        save: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.port = port if port is not None else free_port()
        self.password = password
        self._maxmemory = maxmemory
        self._maxmemory_policy = maxmemory_policy
        self._appendonly = appendonly
        self._save = save
        self._extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://`` URL of this server, with its password when it has one."""
        return self.url_with(password=self.password)

    def url_with(self, *, password: str | None, username: str = "") -> str:
        """The URL with another (or no) password: for wrong-password tests."""
        if password is None:
            return f"redis://{HOST}:{self.port}/0"
        return f"redis://{username}:{password}@{HOST}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def argv(self) -> list[str]:
        argv = [
            REDIS_SERVER,
            "--port", str(self.port),
            "--bind", HOST,
            "--save", self._save if self._save is not None else "",
            "--appendonly", "yes" if self._appendonly else "no",
            "--dir", str(self.workdir),
            "--daemonize", "no",
            "--protected-mode", "no",
        ]  # fmt: skip
        if self._appendonly:
            argv += ["--appendfsync", "always"]
        if self.password is not None:
            argv += ["--requirepass", self.password]
        if self._maxmemory is not None:
            argv += ["--maxmemory", self._maxmemory]
        if self._maxmemory_policy is not None:
            argv += ["--maxmemory-policy", self._maxmemory_policy]
        return argv + list(self._extra_args)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the process and wait until it answers PING (after loading its data)."""
        if self.is_running:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.workdir / "redis.log", "ab")  # closed in _reap()
        self._proc = subprocess.Popen(
            self.argv(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                log = self.log_tail()
                self._reap()
                raise RuntimeError(f"redis-server on port {self.port} exited at start:\n{log}")
            with contextlib.suppress(OSError, RespError):
                if resp_command(self.port, "PING", password=self.password, timeout_s=0.5):
                    return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM by pid, SIGKILL after ``timeout_s``; no-op when not running."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._reap()

    def kill(self) -> None:
        """SIGKILL by pid (a crash: no shutdown save)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._reap()

    def restart(self, timeout_s: float = 10.0) -> RedisServer:
        """Stop (if running) and start again on the same port and directory."""
        self.stop()
        return self.start(timeout_s)

    def client(self, *, password: str | None = None) -> redis.Redis:
        """A redis-py client to this server (close it, or use it as a context manager)."""
        return redis.Redis(
            host=HOST,
            port=self.port,
            password=password if password is not None else self.password,
            socket_timeout=5.0,
        )

    def command(self, *args: str | bytes | int) -> object:
        """One command on a fresh raw connection (see ``resp_command``)."""
        return resp_command(self.port, *args, password=self.password)

    def log_tail(self, num_bytes: int = 4000) -> str:
        try:
            data = (self.workdir / "redis.log").read_bytes()
        except OSError:
            return ""
        return data[-num_bytes:].decode(errors="replace")

    def _reap(self) -> None:
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


class RedisCluster:
    """A Redis Cluster of ``num_masters`` masters and no replicas on loopback ports.

    Each node runs in ``workdir/node-<i>`` with ``--cluster-enabled yes`` and its own free bus
    port (``--cluster-port``); ``start()`` joins them with ``redis-cli --cluster create`` and
    waits for ``cluster_state:ok`` on every node.
    """

    def __init__(self, workdir: Path, *, num_masters: int = 3, node_timeout_ms: int = 2000):
        self.workdir = Path(workdir)
        ports = free_ports(2 * num_masters)  # each node's, then each node's cluster bus
        self.nodes = [
            RedisServer(
                self.workdir / f"node-{i}",
                port=ports[i],
                extra_args=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                    "--cluster-port",
                    str(ports[num_masters + i]),
                ],
            )
            for i in range(num_masters)
        ]

    @property
    def url(self) -> str:
        """A ``redis://`` URL of one node (cluster clients discover the rest)."""
        return self.nodes[0].url

    def start(self, timeout_s: float = 30.0) -> RedisCluster:
        deadline = time.monotonic() + timeout_s
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [
                    REDIS_CLI,
                    "--cluster",
                    "create",
                    *(f"{HOST}:{node.port}" for node in self.nodes),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                capture_output=True,
                stdin=subprocess.DEVNULL,
                timeout=timeout_s,
            )
            for node in self.nodes:
                while b"cluster_state:ok" not in _as_bytes(node.command("CLUSTER", "INFO")):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"cluster node {node.port} never reached state ok")
                    time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def flushall(self) -> None:
        for node in self.nodes:
            node.command("FLUSHALL")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _as_bytes(reply: object) -> bytes:
    return reply if isinstance(reply, bytes) else b""


# --------------------------------------------------------------------------- FaultProxy


@dataclass(frozen=True, slots=True)
class ProxyMode:
    """What the proxy does to traffic: ``name`` and its parameter (ms, bytes or bytes/s)."""

    name: str
    value: float = 0.0
    generation: int = 0


class FaultProxy:
    """An asyncio TCP proxy on 127.0.0.1, in its own thread, in front of one upstream server.

    Modes (switch at any time; live connections follow the new mode from their next chunk):
        pass_through(): forward both ways.
        delay(ms): hold every chunk from the upstream for ``ms`` before forwarding it.
        blackhole(): accept and read, never forward or answer.
        reset_after(n): forward ``n`` more bytes from the upstream on each connection, then
            reset it (RST).
        trickle(bps): forward upstream bytes at ``bps`` bytes per second.
        refuse(): close the listener (connects are refused) and reset live connections; any
            other mode listens again on the same port.

    ``num_connections`` and ``num_bytes_from_client`` count what reached the proxy, so a test
    can prove a client did not touch the network.
    """

    def __init__(self, upstream_port: int, *, upstream_host: str = HOST) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.num_connections = 0
        self.num_bytes_from_client = 0
        self._mode = ProxyMode("pass")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def mode(self) -> ProxyMode:
        return self._mode

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FaultProxy:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self._run(self._listen())
        return self

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        self._run(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        self._loop.close()
        self._loop = None
        self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ modes

    def pass_through(self) -> None:
        self._set(ProxyMode("pass"))

    def delay(self, ms: float) -> None:
        self._set(ProxyMode("delay", ms))

    def blackhole(self) -> None:
        self._set(ProxyMode("blackhole"))

    def reset_after(self, num_bytes: int) -> None:
        self._set(ProxyMode("reset_after", num_bytes))

    def trickle(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError("trickle needs a positive rate")
        self._set(ProxyMode("trickle", bytes_per_s))

    def refuse(self) -> None:
        self._set(ProxyMode("refuse"))

    def _set(self, mode: ProxyMode) -> None:
        was_refusing = self._mode.name == "refuse"
        self._mode = ProxyMode(mode.name, mode.value, self._mode.generation + 1)
        if mode.name == "refuse" and not was_refusing:
            self._run(self._close_all())
        elif was_refusing and mode.name != "refuse":
            self._run(self._listen())

    # ------------------------------------------------------------------ event loop side

    def _run(self, coro: object) -> None:
        assert self._loop is not None, "FaultProxy is not started"
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10.0)  # type: ignore[arg-type]

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._handle, HOST, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            _abort(writer)
        # NOTE: cancel, not wait: a pump may be sleeping in a delay or trickle.
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _shutdown(self) -> None:
        await self._close_all()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.num_connections += 1
        self._writers.add(client_w)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            if self._mode.name == "refuse":
                return
            try:
                upstream_r, upstream_w = await asyncio.open_connection(*self.upstream)
            except OSError:
                return
            self._writers.add(upstream_w)
            await asyncio.gather(
                self._pump_up(client_r, upstream_w),
                self._pump_down(upstream_r, client_w),
                return_exceptions=True,
            )
        finally:
            for writer in (client_w, upstream_w):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.close()
                    with contextlib.suppress(OSError, asyncio.CancelledError):
                        await writer.wait_closed()
            self._tasks.discard(task)

    async def _pump_up(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Client → upstream: forwarded unless blackholed (requests are never delayed)."""
        try:
            while chunk := await src.read(65536):
                self.num_bytes_from_client += len(chunk)
                if self._mode.name == "blackhole":
                    continue
                dst.write(chunk)
                await dst.drain()
        finally:
            _abort(dst)

    async def _pump_down(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Upstream → client, where every fault applies."""
        budget = 0
        budget_generation = -1
        try:
            while chunk := await src.read(65536):
                mode = self._mode
                if mode.name == "blackhole":
                    continue
                if mode.name == "delay":
                    await asyncio.sleep(mode.value / 1000.0)
                elif mode.name == "reset_after":
                    if budget_generation != mode.generation:
                        budget, budget_generation = int(mode.value), mode.generation
                    if len(chunk) >= budget:
                        dst.write(chunk[:budget])
                        await dst.drain()
                        _abort(dst)
                        return
                    budget -= len(chunk)
                elif mode.name == "trickle":
                    await self._trickle(chunk, dst, mode.value)
                    continue
                dst.write(chunk)
                await dst.drain()
        finally:
            _abort(dst)

    @staticmethod
    async def _trickle(chunk: bytes, dst: asyncio.StreamWriter, bytes_per_s: float) -> None:
        step = max(1, int(bytes_per_s / 50))
        for at in range(0, len(chunk), step):
            piece = chunk[at : at + step]
            dst.write(piece)
            await dst.drain()
            await asyncio.sleep(len(piece) / bytes_per_s)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Reset a connection (RST, not FIN), as a crashed peer or middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextlib.contextmanager
def running(*things: RedisServer | RedisCluster | FaultProxy) -> Iterator[None]:
    """Stop every given server, cluster or proxy on exit, whatever happens."""
    try:
        yield
    finally:
        for thing in reversed(things):
            thing.stop()
