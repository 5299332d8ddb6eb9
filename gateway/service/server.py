"""The gRPC server: ``kvgate.v1``, health checking and reflection on one listener.

``GatewayServer`` listens with the limits of ``GrpcSettings``, serves ``kvgate.v1`` (through
``gateway.service.servicer``), standard health checking and reflection. It starts listening before
the model is loaded, so an orchestrator sees the process come up: health says NOT_SERVING (and every
RPC UNAVAILABLE) until an engine is attached, SERVING from then on, NOT_SERVING again once shutdown
begins. What it serves is built elsewhere, by the composition root (``gateway.service.assembly``).

Bearer keys are refused on a plaintext listener that is not loopback: such a server does not
start unless ``allow_insecure_remote`` says a TLS-terminating proxy sits in front.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.config.settings import ServeConfig
from gateway.core.addresses import is_loopback
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.servicer import (
    ADMIN_SERVICE,
    GATEWAY_SERVICE,
    EdgeLimits,
    ServicerSet,
)
from gateway.service.watchdog import EngineWatchdog

if TYPE_CHECKING:
    from gateway.cache.admin import CacheAdmin
    from gateway.engine.engine import Engine

logger = logging.getLogger(__name__)

HEALTH_SERVICES = ("", GATEWAY_SERVICE, ADMIN_SERVICE)
"""Health service names this server answers for ("" is the whole server)."""


class ServeError(RuntimeError):
    """The server cannot start as configured; the message says what to change."""


class GatewayServer:
    """``kvgate.v1`` + health + reflection on one gRPC server.

    Args:
        config: where to listen, TLS, and the gRPC limits (``config.grpc``).
        authenticator: the API keys.
    """

    def __init__(self, config: ServeConfig, authenticator: Authenticator) -> None:
        self.config = config
        self._engines = EngineSlot()
        self._servicers = ServicerSet(
            self._engines,
            authenticator,
            EdgeLimits(max_deadline_s=config.grpc.max_deadline_s,
                       max_ttl_s=config.grpc.max_ttl_s),
        )
        self._health = health.HealthServicer()
        self._watchdog: EngineWatchdog | None = None
        self.engine_died = threading.Event()
        """Set when the attached engine's worker thread died (health is NOT_SERVING then)."""
        self._server: Any = None
        self._pool: futures.ThreadPoolExecutor | None = None
        self.port: int | None = None

    def start(self) -> int:
        """Listen and serve (health NOT_SERVING until ``attach``); returns the bound port.

        Raises:
            ServeError: a plaintext non-loopback listener without ``allow_insecure_remote``, or
                the address cannot be bound.
        """
        config = self.config
        if not config.uses_tls and not is_loopback(config.host):
            if not config.allow_insecure_remote:
                raise ServeError(
                    f"refusing to listen on {config.address} without TLS: API keys would "
                    "travel in the clear. Set tls_cert and tls_key, listen on 127.0.0.1, or "
                    "pass --allow-insecure-remote if a TLS-terminating proxy is in front"
                )
            logger.warning("listening on %s without TLS (allow_insecure_remote): API keys "
                           "travel in the clear on this hop", config.address)
        settings = config.grpc
        self._pool = futures.ThreadPoolExecutor(
            max_workers=settings.max_concurrent_rpcs, thread_name_prefix="kvgate-rpc"
        )
        server = grpc.server(
            self._pool,
            handlers=self._servicers.generic_handlers(),
            options=settings.server_options(),
            maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
        )
        for service in HEALTH_SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (GATEWAY_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME),
            server,
        )
        try:
            if config.uses_tls:
                assert config.tls_cert is not None and config.tls_key is not None
                credentials = grpc.ssl_server_credentials(
                    [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
                )
                port = server.add_secure_port(config.address, credentials)
            else:
                port = server.add_insecure_port(config.address)
        except (RuntimeError, OSError) as exc:
            self._pool.shutdown(wait=False)
            raise ServeError(f"cannot listen on {config.address} ({exc}); is another "
                             "process using the port?") from exc
        server.start()
        self._server = server
        self.port = int(port)
        return self.port

    def attach(self, engine: Engine, admin: CacheAdmin | None) -> None:
        """Serve with ``engine``, and the Admin service with ``admin`` (None: no cache), from
        now on: health SERVING, and NOT_SERVING (``engine_died`` set) if its worker dies."""
        self._engines.attach(engine, admin)
        for service in HEALTH_SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._stop_watchdog()
        self._watchdog = EngineWatchdog(lambda: engine.is_worker_dead, self._on_engine_death)
        self._watchdog.start()

    def _on_engine_death(self) -> None:
        for service in HEALTH_SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.engine_died.set()

    def _stop_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()

    def begin_shutdown(self) -> threading.Event:
        """Health NOT_SERVING, refuse new calls; calls in flight go on for the grace period.

        Returns:
            An event set once every call has ended (at the latest after the grace period).
        """
        self._stop_watchdog()
        self._health.enter_graceful_shutdown()
        if self._server is None:
            done = threading.Event()
            done.set()
            return done
        event: threading.Event = self._server.stop(self.config.grpc.shutdown_grace_s)
        return event

    def stop(self, grace_s: float | None = None) -> None:
        """Stop now (calls in flight get ``grace_s``, default none) and wait for it."""
        self._stop_watchdog()
        self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
