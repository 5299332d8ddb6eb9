"""A gateway whose engine worker dies stops saying SERVING and exits with an error.

``serve`` (what ``kvgate serve`` runs) in a thread of this process, on the tiny Llama; the test
ends the engine's worker thread the way an escaped bug would -- an exception raised inside it
that the step loop does not catch (``SystemExit``, delivered with
``PyThreadState_SetAsyncExc``) -- and watches health, the request in flight and ``serve``.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cache.operations.factory import CacheConfig
from gateway.client import KvgateClient, KvgateError, RetryPolicy
from gateway.config.settings import GrpcSettings, ServeConfig
from gateway.engine.models.loading import load_model
from gateway.service.assembly import serve
from gateway.service.server import ServeError
from gateway.service.servicer import GATEWAY_SERVICE
from tests.gateway.grpc_harness import KEY_A, KEYS, LONG_PROMPT, start_gateway, wait_until
from tests.tiny_llama import save_tiny_llama

_SERVING = re.compile(r"SERVING kvgate\.v1 on 127\.0\.0\.1:(\d+)")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kvgate-engine" and t.is_alive()}


def _kill(thread: threading.Thread) -> None:
    """Raise SystemExit inside ``thread`` at its next Python instruction."""
    assert thread.ident is not None
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                      ctypes.py_object(SystemExit))
    assert done == 1


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        status: int = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5).status
    return status


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_a_dead_worker_turns_health_not_serving_and_fails_requests_instead_of_hanging(
    model_dir: Path,
) -> None:
    before = _engine_threads()
    running = start_gateway(load_model(str(model_dir)))
    try:
        assert running.health() == health_pb2.HealthCheckResponse.SERVING
        (worker,) = _engine_threads() - before
        _kill(worker)  # pending until the idle worker wakes: the next request wakes it
        with pytest.raises(KvgateError) as failed:
            running.client(KEY_A).warm(LONG_PROMPT)
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE  # failed, not left waiting
        assert wait_until(lambda: running.server.engine_died.is_set(), 5.0)
        assert running.health() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert running.health(GATEWAY_SERVICE) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(KvgateError) as refused:  # new requests are refused at once
            running.client(KEY_A).generate_text(LONG_PROMPT, max_tokens=2)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        running.stop()


def test_serve_exits_with_an_error_when_its_worker_dies(tmp_path: Path, model_dir: Path) -> None:
    config = ServeConfig(
        host="127.0.0.1", port=0, data_dir=tmp_path / "data",
        model=str(model_dir), keys=KEYS,
        grpc=GrpcSettings(shutdown_grace_s=1.0),
        cache=CacheConfig(block_tokens=16, device_bytes=64 << 20, host_bytes=0, disk_bytes=0))
    lines = _Lines()
    assembly_log = logging.getLogger("gateway.service.assembly")
    level = assembly_log.level
    assembly_log.setLevel(logging.INFO)
    assembly_log.addHandler(lines)
    before = _engine_threads()
    stop = threading.Event()
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            serve(config, env={}, stop_requested=stop, announce=lambda line: None)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    server = threading.Thread(target=run, name="test-serve")
    server.start()
    try:
        deadline = time.monotonic() + 60.0
        while not any(_SERVING.search(line) for line in lines.lines):
            assert server.is_alive() and time.monotonic() < deadline, outcome
            time.sleep(0.05)
        port = int(next(m.group(1) for m in map(_SERVING.search, lines.lines) if m))
        assert _health(port) == health_pb2.HealthCheckResponse.SERVING
        (worker,) = _engine_threads() - before

        _kill(worker)
        with KvgateClient("127.0.0.1", port, KEY_A, timeout_s=10.0,
                          retry=RetryPolicy(max_attempts=1)) as client, \
                pytest.raises(KvgateError):
            client.warm(LONG_PROMPT)  # wakes the worker, which dies
        server.join(15.0)  # serve shut down by itself, nobody asked it to stop ...
        assert not server.is_alive() and not stop.is_set()
        assert len(outcome) == 1 and isinstance(outcome[0], ServeError)  # ... with an error,
        assert "worker thread died" in str(outcome[0])  # which kvgate serve turns into exit 1
    finally:
        stop.set()
        server.join(30.0)
        assembly_log.removeHandler(lines)
        assembly_log.setLevel(level)
