"""Descriptor exhaustion logs one line per burst, never a traceback (issue 44, LOW).

The review saw 39 to 1,707 "Too many open files" tracebacks per burst: asyncio's accept loop
logs each failed ``accept()`` with its traceback, up to the listen backlog (2,048) times per
loop tick. Here a real ``kvgate serve`` (tiny Llama) is started by the module; once it serves,
its open-file limit is lowered to a few above what it holds (``prlimit`` on its pid) and more
connections than that are opened to the HTTP front, then the limit is restored; the server is
stopped by pid. Before the fix its stderr held thousands of tracebacks for this.
"""

from __future__ import annotations

import asyncio
import errno
import http.client
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.service.http.accept_errors import AcceptErrorLog
from tests.tiny_llama import save_tiny_llama

KVGATE = str(Path(sys.executable).parent / "kvgate")
API_KEY = "kvg-accept-tenant-Pz5Ga8Ku3Yf0Nr7Bx2Me4"
LINE = "HTTP front: cannot accept connections: Too many open files (EMFILE)"
BOUND_S = 30.0
_SERVING = re.compile(r"SERVING kvgate\.v1 on 127\.0\.0\.1:(\d+)")
_HTTP = re.compile(r"OpenAI-compatible HTTP on http://127\.0\.0\.1:(\d+)/v1")


class Burst:
    def __init__(self, log: str, http_port: int) -> None:
        self.log = log
        self.http_port = http_port


@pytest.fixture(scope="module")
def burst(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Burst]:
    root = tmp_path_factory.mktemp("accept")
    model = save_tiny_llama(root / "model")
    config = root / "kvgate.toml"
    config.write_text('[grpc]\nshutdown_grace_s = 1\n[http]\nport = 0\n[cache]\n'
                      'block_tokens = 16\ndevice_bytes = "16MiB"\nhost_bytes = 0\ndisk_bytes = 0\n',
                      encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env["KVGATE_API_KEYS"] = f"{API_KEY}=tenant-a"
    err_path = root / "serve.err"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(
            [KVGATE, "serve", "--config", str(config), "--port", "0", "--data-dir",
             str(root / "data"), "--model", str(model)],
            stdout=subprocess.DEVNULL, stderr=err, env=env)
    clients: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 90.0
        while not _SERVING.search(err_path.read_text(errors="replace")):
            assert proc.poll() is None, err_path.read_text(errors="replace")
            assert time.monotonic() < deadline, err_path.read_text(errors="replace")
            time.sleep(0.05)
        match = _HTTP.search(err_path.read_text(errors="replace"))
        assert match is not None
        http_port = int(match.group(1))
        limits = resource.prlimit(proc.pid, resource.RLIMIT_NOFILE)
        num_open = len(os.listdir(f"/proc/{proc.pid}/fd"))
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (num_open + 4, limits[1]))
        start = len(err_path.read_text(errors="replace"))
        for _ in range(32):
            clients.append(socket.create_connection(("127.0.0.1", http_port), timeout=5.0))
        deadline = time.monotonic() + BOUND_S
        while LINE not in err_path.read_text(errors="replace")[start:]:
            assert time.monotonic() < deadline, err_path.read_text(errors="replace")[start:]
            time.sleep(0.05)
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, limits)
        for client in clients:
            client.close()
        clients.clear()
        yield Burst(err_path.read_text(errors="replace")[start:], http_port)
    finally:
        for client in clients:
            client.close()
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30.0)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_burst_of_failed_accepts_logs_no_traceback(burst: Burst) -> None:
    assert "Traceback" not in burst.log
    assert "socket.accept() out of system resource" not in burst.log


def test_a_burst_of_failed_accepts_is_one_warning_line_saying_what_to_do(burst: Burst) -> None:
    (line,) = [line for line in burst.log.splitlines() if LINE in line]
    assert " WARNING " in line and "ulimit -n" in line and "max_connections" in line


def test_the_front_serves_again_once_descriptors_free_up(burst: Burst) -> None:
    deadline = time.monotonic() + BOUND_S
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", burst.http_port, timeout=5.0)
        try:
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            return
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        finally:
            conn.close()


# ---- the handler alone, with a fake clock ---------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _emfile() -> dict[str, Any]:
    return {"message": "socket.accept() out of system resource", "socket": object(),
            "exception": OSError(errno.EMFILE, "Too many open files")}


def test_failed_accepts_within_the_interval_are_counted_into_the_next_line(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    handler = AcceptErrorLog(interval_s=10.0, clock=clock)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.service.http.accept_errors"):
            for _ in range(2048):
                handler(loop, _emfile())
            clock.now = 10.0
            for _ in range(5):
                handler(loop, _emfile())
    finally:
        loop.close()
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert "; 1 accept(s) failed" in lines[0] and "; 2048 accept(s) failed" in lines[1]
    assert handler.num_failed == 2053
    assert all(record.exc_info is None for record in caplog.records)


def test_any_other_loop_error_goes_to_asyncios_own_handler(
        caplog: pytest.LogCaptureFixture) -> None:
    handler = AcceptErrorLog(clock=_Clock())
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            handler(loop, {"message": "boom", "exception": RuntimeError("boom")})
    finally:
        loop.close()
    assert [record.getMessage() for record in caplog.records] == ["boom"]
    assert handler.num_failed == 0


def test_the_failed_accepts_are_counted_in_a_metric(burst: Burst) -> None:
    test_the_front_serves_again_once_descriptors_free_up(burst)
    conn = http.client.HTTPConnection("127.0.0.1", burst.http_port, timeout=5.0)
    try:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    (value,) = [float(line.split()[1]) for line in body.splitlines()
                if line.startswith("kvgate_http_accept_errors_total ")]
    assert value >= 1
