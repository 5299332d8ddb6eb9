"""The gRPC server, and ``kvgate serve``'s composition root.

``GatewayServer`` listens with the limits of ``GrpcSettings``, serves ``kvgate.v1`` (through
``gateway.service.servicer``), standard health checking and reflection. It starts listening before
the model is loaded, so an orchestrator sees the process come up: health says NOT_SERVING (and every
RPC UNAVAILABLE) until an engine is attached, SERVING from then on, NOT_SERVING again once shutdown
begins.

``serve`` builds everything from one ``ServeConfig`` -- secret, keys, server, model, cache,
metrics, engine -- and runs until asked to stop. The Prometheus endpoint (``[metrics]``) comes
up once the cache is open. Shutdown order (SIGTERM): health NOT_SERVING; the server stops
taking calls (new ones fail UNAVAILABLE, so clients retry elsewhere) while calls in flight go
on; the engine finishes or cancels them within the grace period; the metrics endpoint stops;
the cache flushes pending disk writes and closes.

Bearer keys are refused on a plaintext listener that is not loopback: such a server does not
start unless ``allow_insecure_remote`` says a TLS-terminating proxy sits in front.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.config.secrets import (
    DEV_TENANT,
    deployment_secret,
    dev_api_key,
    dev_key_entry,
    ensure_private_dir,
)
from gateway.config.settings import ServeConfig
from gateway.core.addresses import is_loopback
from gateway.service.auth import Authenticator
from gateway.service.servicer import (
    ADMIN_SERVICE,
    GATEWAY_SERVICE,
    EdgeLimits,
    EngineSlot,
    ServicerSet,
)

if TYPE_CHECKING:
    from gateway.cache.prefix_cache import PrefixCache
    from gateway.engine.engine import Engine
    from gateway.service.metrics import GatewayMetrics

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

    def attach(self, engine: Engine) -> None:
        """Serve with ``engine`` from now on: health SERVING."""
        self._engines.attach(engine)
        for service in HEALTH_SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def begin_shutdown(self) -> threading.Event:
        """Health NOT_SERVING, refuse new calls; calls in flight go on for the grace period.

        Returns:
            An event set once every call has ended (at the latest after the grace period).
        """
        self._health.enter_graceful_shutdown()
        if self._server is None:
            done = threading.Event()
            done.set()
            return done
        event: threading.Event = self._server.stop(self.config.grpc.shutdown_grace_s)
        return event

    def stop(self, grace_s: float | None = None) -> None:
        """Stop now (calls in flight get ``grace_s``, default none) and wait for it."""
        self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def build_authenticator(
    config: ServeConfig, announce: Callable[[str], None]
) -> Authenticator:
    """The configured keys; with none, the development key of tenant ``default``."""
    if config.keys:
        return Authenticator(config.keys)
    key = dev_api_key(config)
    announce(
        f"no API keys configured: development key for tenant {DEV_TENANT!r}: {key}\n"
        f"(saved in {config.dev_key_path}; `kvgate generate` on this machine uses it)"
    )
    return Authenticator([dev_key_entry(key)])


def start_metrics(config: ServeConfig, cache: PrefixCache) -> GatewayMetrics:
    """The metrics of ``cache`` and the requests, served on ``config.metrics``' address.

    Raises:
        ServeError: the address cannot be bound.
    """
    from gateway.service.metrics import GatewayMetrics

    settings = config.metrics
    metrics = GatewayMetrics(cache_stats=cache.stats)
    try:
        port = metrics.start(settings.host, settings.port)
    except OSError as exc:
        raise ServeError(f"cannot serve metrics on {settings.host}:{settings.port} ({exc}); "
                         "is another process using the port?") from exc
    if not is_loopback(settings.host):
        logger.warning("the metrics endpoint on %s has no authentication and shows per-tenant "
                       "counters: let only your scraper reach it", settings.host)
    logger.info("metrics on http://%s:%d/metrics", settings.host, port)
    return metrics


def serve(
    config: ServeConfig,
    *,
    env: Mapping[str, str],
    stop_requested: threading.Event,
    announce: Callable[[str], None],
) -> None:
    """Run the gateway until ``stop_requested`` is set, then shut down gracefully.

    Args:
        config: the validated configuration.
        env: the environment (for ``KVGATE_DEPLOYMENT_SECRET``).
        stop_requested: set by the signal handler (SIGTERM, SIGINT).
        announce: writes a line for the operator's console (the development key).

    Raises:
        ServeError, gateway.config.settings.ConfigError, gateway.engine.model.ModelLoadError:
            it could not start.
    """
    ensure_private_dir(config.data_dir)
    secret = deployment_secret(config, env)
    authenticator = build_authenticator(config, announce)
    server = GatewayServer(config, authenticator)
    server.start()
    # NOTE: imported once listening, so that health answers (NOT_SERVING) during the import.
    from gateway.cache.factory import open_cache
    from gateway.engine.engine import Engine, EngineConfig
    from gateway.engine.model import load_model

    logger.info("listening on %s:%d; loading the model %s", config.host, server.port,
                config.model)
    opened = None
    engine: Engine | None = None
    metrics: GatewayMetrics | None = None
    try:
        loaded = load_model(config.model, cache_dir=config.data_dir / "models")
        opened = open_cache(config.cache, layout=loaded.layout, deployment_secret=secret)
        if config.metrics.enabled:
            metrics = start_metrics(config, opened.cache)
        engine = Engine(
            loaded=loaded,
            cache=opened.cache,
            config=EngineConfig(
                block_tokens=config.cache.block_tokens,
                max_queue=config.engine.max_queue,
                default_ttl_s=config.engine.default_ttl_s,
                max_prompt_tokens=config.engine.max_prompt_tokens,
                max_deadline_s=config.grpc.max_deadline_s,
                route=config.engine.route,
                step_tokens=config.engine.step_tokens,
                max_running=config.engine.max_running,
                max_running_per_tenant=config.engine.max_running_per_tenant,
                max_queued_per_tenant=config.engine.max_queued_per_tenant,
                kv_budget_bytes=config.engine.kv_budget_bytes,
            ),
            deployment_secret=secret,
            metrics=metrics,
        )
        engine.start()
        if not stop_requested.is_set():
            server.attach(engine)
            logger.info(
                "kvgate SERVING kvgate.v1 on %s:%d (%s, model %s, tiers %s, %d API key(s), "
                "engine route %s: %s)",
                config.host, server.port, "TLS" if config.uses_tls else "plaintext",
                engine.model_name, "+".join(opened.cache.tier_names), authenticator.num_keys,
                engine.route.name, engine.route.reason,
            )
            stop_requested.wait()
        logger.info("shutting down: finishing requests in flight (grace %.0f s)",
                    config.grpc.shutdown_grace_s)
    finally:
        stopped = server.begin_shutdown()
        if engine is not None:
            engine.stop(config.grpc.shutdown_grace_s)
        stopped.wait(config.grpc.shutdown_grace_s + 1.0)
        server.stop(0)
        if metrics is not None:
            metrics.stop()
        if opened is not None:
            opened.close()
        logger.info("stopped")

