"""Fixtures shared by every test package."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.redis_harness import FaultProxy, RedisCluster, RedisServer, redis_server_missing

# ------------------------------------------------------------------ Redis (tests/redis_harness.py)
#
# Real Debian redis-server processes on free loopback ports, stopped by pid when the test (or
# module) ends. Without redis-server or redis-cli these skip with a message, except when
# KVGATE_REQUIRE_REDIS=1 (`make test` sets it): then the run stops at once, naming the missing
# binary. Tests using them carry `pytest.mark.redis` (added below for any test that requests one
# of these fixtures).

REQUIRE_REDIS_ENV = "KVGATE_REQUIRE_REDIS"

_REDIS_FIXTURES = frozenset(
    {"redis_server", "redis_server_factory", "module_redis_server", "redis_cluster",
     "fault_proxy"}
)


def _redis_is_required() -> bool:
    return os.environ.get(REQUIRE_REDIS_ENV, "") not in ("", "0")


# ------------------------------------------------------------------ GPU
#
# Tests marked `gpu` need CUDA: without it they skip, with one line saying so -- except when
# KVGATE_REQUIRE_GPU=1 (`make test-gpu` sets it), where a missing GPU or a CPU build of torch
# stops the run at once instead of skipping everything it was meant to check.

REQUIRE_GPU_ENV = "KVGATE_REQUIRE_GPU"


def _gpu_missing() -> str | None:
    import torch

    if torch.cuda.is_available():
        return None
    return f"needs CUDA (torch {torch.__version__} sees no GPU)"


def pytest_configure(config: pytest.Config) -> None:
    reason = redis_server_missing()
    if reason is not None and _redis_is_required():
        raise pytest.UsageError(
            f"{REQUIRE_REDIS_ENV} is set and the Redis tests cannot run: {reason}")
    if os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0"):
        missing = _gpu_missing()
        if missing is not None:
            raise pytest.UsageError(f"{REQUIRE_GPU_ENV} is set and the GPU tests cannot run: "
                                    f"{missing}; install a CUDA build of torch")


SOAK_ENV = "KVGATE_SOAK"
"""Set (``make soak-ci``): run the tests marked ``soak``, minutes each; skipped otherwise."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gpu_missing: str | None = None
    checked_gpu = False
    runs_soak = os.environ.get(SOAK_ENV, "") not in ("", "0")
    for item in items:
        if item.get_closest_marker("soak") is not None and not runs_soak:
            item.add_marker(pytest.mark.skip(reason=f"a soak run: minutes long ({SOAK_ENV}=1, "
                                                    "`make soak-ci`)"))
        if _REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)
        if item.get_closest_marker("gpu") is not None:
            if not checked_gpu:
                gpu_missing, checked_gpu = _gpu_missing(), True
            if gpu_missing is not None:
                item.add_marker(pytest.mark.skip(reason=gpu_missing))


def _skip_without_redis() -> None:
    reason = redis_server_missing()
    if reason is not None:
        if _redis_is_required():
            pytest.fail(f"{REQUIRE_REDIS_ENV} is set: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start servers with ``RedisServer`` options (password=, maxmemory=, appendonly=, ...);
    all of them are stopped when the test ends."""
    _skip_without_redis()
    servers: list[RedisServer] = []

    def start(**options: Any) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", **options)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh, empty redis-server (no persistence) for one test."""
    return redis_server_factory()


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server (no persistence) shared by a module's tests; never emptied by the
    fixture (for data one process writes and many tests read)."""
    _skip_without_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis-module")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fault_proxy(redis_server: RedisServer) -> Iterator[FaultProxy]:
    """A ``FaultProxy`` in pass mode in front of ``redis_server`` (connect to ``.url``)."""
    proxy = FaultProxy(redis_server.port).start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture(scope="module")
def _redis_cluster_of_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    _skip_without_redis()
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(_redis_cluster_of_module: RedisCluster) -> RedisCluster:
    """A 3-master Redis Cluster shared by a module's tests, emptied before each test."""
    _redis_cluster_of_module.flushall()
    return _redis_cluster_of_module


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which machine the suite runs on, and the route the engine finds here for the tiny Llama
    in each dtype (issue 21: a red run names its machine)."""
    import tempfile

    import torch

    from gateway.engine.engine import EngineConfig
    from gateway.engine.models.loading import load_model
    from gateway.engine.parity.route_search import search_route
    from gateway.engine.parity.verdicts import cpu_identity
    from tests.tiny_llama import save_tiny_llama

    lines = [f"kvgate machine: {cpu_identity()}", f"kvgate torch: {torch.__version__}, "
             f"{torch.get_num_threads()} threads"]
    with tempfile.TemporaryDirectory() as directory:
        model_dir = save_tiny_llama(Path(directory) / "tiny")
        for dtype in (torch.float32, torch.bfloat16):
            verdict = search_route(load_model(str(model_dir), dtype=dtype),
                                   EngineConfig().search_settings())
            detail = (f"{verdict.kernel} padded {verdict.padding}, {verdict.attention} "
                      "attention" if verdict.name == "batched" else verdict.reason)
            lines.append(f"kvgate route (tiny Llama, {str(dtype).removeprefix('torch.')}): "
                         f"{verdict.name}: {detail}")
    return lines
