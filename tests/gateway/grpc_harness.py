"""Harness for the gRPC tests: a real gateway in this process, on a free loopback port.

``start_gateway`` builds what ``kvgate serve`` builds -- tiny Llama (``tests.tiny_llama``), real
cache (``open_cache``), real ``Engine``, real ``GatewayServer`` -- with small blocks so that short
prompts span several. Tests talk to it through the real client or a raw channel. Nothing here is
a fake: the point is the wire.

(This module holds no tests; it is named ``test_grpc_*`` to sit with the tests that use it.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.factory import CacheConfig, OpenedCache, open_cache
from gateway.client import KvgateClient, RetryPolicy
from gateway.config.keys import KeyEntry
from gateway.config.limits import LimitSettings
from gateway.config.settings import GrpcSettings, ServeConfig
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.metrics import GatewayMetrics
from gateway.service.prompt_comparisons import PromptComparisons
from gateway.service.server import GatewayServer
from tests.tiny_llama import save_tiny_llama

BLOCK = 16
SECRET = b"grpc-test-secret-000000000000001"
KEY_A = "tenant-a-key-Rw4Tx9Lq2Zm7Kc5V"
KEY_B = "tenant-b-key-Hn3Pj8Wd6Ys1Fg4B"
ADMIN_KEY = "admin-key-Qe7Mz2Vk9Tr4Xa6Nu3"
KEYS = (
    KeyEntry.of_key(KEY_A, "tenant-a"),
    KeyEntry.of_key(KEY_B, "tenant-b"),
    KeyEntry.of_key(ADMIN_KEY, "ops", is_admin=True),
)
ALL_KEYS = (KEY_A, KEY_B, ADMIN_KEY)

LONG_PROMPT = (
    "You are a careful assistant. Answer in one sentence, cite nothing, and keep every number "
    "exact. The question follows after this long shared preamble, which spans several blocks."
)
"""A prompt of several 16-token blocks with the test tokenizer."""


def tiny_model(directory: Path) -> LoadedModel:
    return load_model(str(save_tiny_llama(directory)))


@dataclass
class RunningGateway:
    """A started gateway; ``stop`` ends everything it started."""

    server: GatewayServer
    engine: Engine | None
    opened: OpenedCache | None
    port: int
    clients: list[KvgateClient] = field(default_factory=list)
    channels: list[Any] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, api_key: str | None = None, **options: Any) -> KvgateClient:
        options.setdefault("timeout_s", 30.0)
        options.setdefault("retry", RetryPolicy(max_attempts=1))
        options.setdefault("admin_port", self.server.admin_port)
        client = KvgateClient("127.0.0.1", self.port, api_key, **options)
        self.clients.append(client)
        return client

    def channel(self) -> Any:
        channel = grpc.insecure_channel(self.target)
        self.channels.append(channel)
        return channel

    def health(self, service: str = "") -> Any:
        stub = health_pb2_grpc.HealthStub(self.channel())
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def total_refcount(self) -> int:
        assert self.opened is not None
        return self.opened.cache.total_refcount()

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        for channel in self.channels:
            channel.close()
        self.server.stop(0)
        if self.engine is not None:
            self.engine.stop(grace_s=2.0)
        if self.opened is not None:
            self.opened.close()


def start_gateway(
    loaded: LoadedModel | None,
    *,
    grpc_settings: GrpcSettings | None = None,
    engine_config: EngineConfig | None = None,
    cache_config: CacheConfig | None = None,
    keys: tuple[KeyEntry, ...] = KEYS,
    engines: EngineSlot | None = None,
    metrics: GatewayMetrics | None = None,
    limits: LimitSettings | None = None,
    admin_listener: bool = False,
    comparisons: PromptComparisons | None = None,
) -> RunningGateway:
    """A gateway on a free loopback port; with ``loaded`` None, one still loading its model.

    ``engines`` is the slot it serves from (to share it with an HTTP front, as ``kvgate serve``
    does); ``metrics`` records the engine's requests. With ``admin_listener``, the Admin
    service on a free port of its own. ``comparisons`` are the request shapes a Lookup may
    name (pass the HTTP front's too, as ``kvgate serve`` does; default: the server's own)."""
    config = ServeConfig(host="127.0.0.1", port=0, keys=keys,
                         grpc=grpc_settings or GrpcSettings(), limits=limits or LimitSettings(),
                         admin_port=0 if admin_listener else None)
    if comparisons is None:
        comparisons = PromptComparisons(
            block_tokens=engine_config.block_tokens if engine_config is not None else BLOCK)
    server = GatewayServer(config, Authenticator(keys), engines, comparisons=comparisons)
    port = server.start()
    running = RunningGateway(server=server, engine=None, opened=None, port=port)
    if loaded is not None:
        attach_engine(running, loaded, engine_config=engine_config, cache_config=cache_config,
                      metrics=metrics)
    return running


def attach_engine(
    running: RunningGateway,
    loaded: LoadedModel,
    *,
    engine_config: EngineConfig | None = None,
    cache_config: CacheConfig | None = None,
    metrics: GatewayMetrics | None = None,
) -> None:
    """Open a cache, start an engine on ``loaded`` and attach it: the model has loaded."""
    running.opened = open_cache(
        cache_config or CacheConfig(block_tokens=BLOCK, device_bytes=64 << 20,
                                    host_bytes=64 << 20),
        layout=loaded.layout, deployment_secret=SECRET,
    )
    running.engine = Engine(loaded=loaded, cache=running.opened.cache,
                            config=engine_config or EngineConfig(block_tokens=BLOCK),
                            deployment_secret=SECRET, metrics=metrics,
                            pool=running.opened.pool)
    running.engine.start()
    admin = CacheAdmin(running.opened.cache, keys=running.engine)
    running.server.attach(running.engine, admin)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()
