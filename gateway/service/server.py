"""The gRPC server: ``kvgate.v1``, health checking and reflection, on one listener or two.

``GatewayServer`` listens with the limits of ``GrpcSettings``, serves ``kvgate.v1`` (through
``gateway.service.dispatch`` and ``gateway.service.servicer``), standard health checking and
reflection. No call takes a worker thread before its key is checked and it is admitted
(``gateway.service.call_gate``, ``gateway.service.admission``): the worker pool has one thread
per admission slot (``[limits] max_calls``), health and reflection have pools of their own,
refusals a small one, and there is no server-wide ``maximum_concurrent_rpcs`` (it counted calls
before their keys were checked). With ``[server] admin_port`` the Admin service has a listener of
its own (health and reflection on both), so that a network policy can keep it from the apps.

It starts listening before the model is loaded, so an orchestrator sees the process come up:
health says NOT_SERVING (and every RPC UNAVAILABLE) until an engine is attached, SERVING from then
on, NOT_SERVING again once shutdown begins. What it serves is built elsewhere, by the composition
root (``gateway.service.assembly``).

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
from gateway.core.prompt_limits import PromptLimits
from gateway.service.access_log import AccessLog
from gateway.service.admission import Admission
from gateway.service.auth import Authenticator
from gateway.service.call_gate import BodyWatchdog, CallGate, PublicServicesGate
from gateway.service.dispatch import ServicerSet
from gateway.service.edge import EdgeLimits
from gateway.service.engine_slot import EngineSlot
from gateway.service.prompt_comparisons import PromptComparisons
from gateway.service.servicer import ADMIN_SERVICE, GATEWAY_SERVICE
from gateway.service.watchdog import EngineWatchdog

if TYPE_CHECKING:
    from gateway.cache.operations.admin import CacheAdmin
    from gateway.engine.engine import Engine

logger = logging.getLogger(__name__)

HEALTH_SERVICES = ("", GATEWAY_SERVICE, ADMIN_SERVICE)
"""Health service names this server answers for ("" is the whole server)."""

REFUSAL_THREADS = 2
"""Threads that end refused calls (each refusal takes microseconds and reads no body)."""

REFLECTION_THREADS = 2
"""Threads (and calls in flight) of server reflection: tools, not traffic."""

SPARE_WORKERS = 4
"""Worker threads beyond the admission slots: a call's thread finishes its last bookkeeping
just after its slot is released, and the next admitted call must not wait for it."""


class ServeError(RuntimeError):
    """The server cannot start as configured; the message says what to change."""


def check_plaintext_listener(config: ServeConfig, host: str, address: str) -> None:
    """Refuse a plaintext listener on a non-loopback ``host`` (bearer keys would travel in the
    clear) unless ``allow_insecure_remote`` says a TLS-terminating proxy is in front.

    Raises:
        ServeError: plaintext, not loopback, and not allowed.
    """
    if config.uses_tls or is_loopback(host):
        return
    if not config.allow_insecure_remote:
        raise ServeError(
            f"refusing to listen on {address} without TLS: API keys would travel in the "
            "clear. Set tls_cert and tls_key, listen on 127.0.0.1, or pass "
            "--allow-insecure-remote if a TLS-terminating proxy is in front"
        )
    logger.warning("listening on %s without TLS (allow_insecure_remote): API keys travel in "
                   "the clear on this hop", address)


class GatewayServer:
    """``kvgate.v1`` + health + reflection on one gRPC server.

    Args:
        config: where to listen, TLS, the gRPC limits (``config.grpc``) and the per-key limits
            (``config.limits``).
        authenticator: the API keys.
        engines: the slot the engine will be attached to (shared with the HTTP front; default
            a slot of its own).
        admission: the per-key limits' state (default: a new one from ``config.limits``; pass
            one to share it with another front).
        comparisons: the shapes of recent requests that ``Lookup`` may name (pass the HTTP
            front's, so that its ids can be named too; default: the server's own, of
            ``[cache] block_tokens``).
    """

    def __init__(self, config: ServeConfig, authenticator: Authenticator,
                 engines: EngineSlot | None = None, admission: Admission | None = None,
                 comparisons: PromptComparisons | None = None) -> None:
        self.config = config
        self._engines = engines if engines is not None else EngineSlot()
        self._authenticator = authenticator
        self.admission = admission if admission is not None else Admission(config.limits)
        self._servicers = ServicerSet(
            self._engines,
            EdgeLimits(max_deadline_s=config.grpc.max_deadline_s,
                       max_ttl_s=config.grpc.max_ttl_s,
                       prompt=PromptLimits(max_chars=config.limits.max_prompt_chars,
                                           max_messages=config.limits.max_messages)),
            access=AccessLog(is_enabled=config.logging.access_log, is_json=config.logging.json),
            tenants=authenticator.tenants,
            comparisons=(comparisons if comparisons is not None
                         else PromptComparisons(block_tokens=config.cache.block_tokens)),
        )
        self._health = health.HealthServicer()
        self._servers: list[Any] = []
        self._engine_watchdog: EngineWatchdog | None = None
        self.engine_died = threading.Event()
        """Set when the attached engine's worker thread died (health is NOT_SERVING then)."""
        self._pools: list[futures.ThreadPoolExecutor] = []
        self._watchdog = BodyWatchdog(config.grpc.body_timeout_s)
        self.port: int | None = None
        self.admin_port: int | None = None

    def start(self) -> int:
        """Listen and serve (health NOT_SERVING until ``attach``); returns the bound port.

        With ``config.admin_port`` set, the Admin service listens there, alone (with health and
        reflection), and the main listener serves the Gateway service only; ``admin_port``
        then holds its bound port.

        Raises:
            ServeError: a plaintext non-loopback listener without ``allow_insecure_remote``, or
                an address cannot be bound.
        """
        config = self.config
        admin_address = config.admin_address
        for address, host in ((config.address, config.host),
                              (admin_address, config.admin_host)):
            if address is not None:
                check_plaintext_listener(config, host, address)
        settings = config.grpc

        def pool(size: int, name: str) -> futures.ThreadPoolExecutor:
            self._pools.append(futures.ThreadPoolExecutor(max_workers=size,
                                                          thread_name_prefix=name))
            return self._pools[-1]

        workers = pool(config.limits.max_calls + SPARE_WORKERS, "kvgate-rpc")
        refusals = pool(REFUSAL_THREADS, "kvgate-refuse")
        gate = CallGate(self._authenticator, self.admission, self._watchdog,
                        worker_pool=workers, refusal_pool=refusals)
        public = PublicServicesGate(
            {health.SERVICE_NAME: (pool(settings.health_threads, "kvgate-health"),
                                   settings.health_threads),
             reflection.SERVICE_NAME: (pool(REFLECTION_THREADS, "kvgate-reflect"),
                                       REFLECTION_THREADS)},
            self._watchdog, refusals)
        self._watchdog.start()
        for service in HEALTH_SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        gateway_service, admin_service = self._servicers.keyed_services(gate)
        listeners = ([(config.address, (gateway_service,), GATEWAY_SERVICE),
                      (admin_address, (admin_service,), ADMIN_SERVICE)]
                     if admin_address is not None else
                     [(config.address, (gateway_service, admin_service), None)])
        ports = []
        for address, handlers, only in listeners:
            assert address is not None
            server = grpc.server(workers, handlers=handlers, interceptors=(public,),
                                 options=settings.server_options())
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
            named = (GATEWAY_SERVICE, ADMIN_SERVICE) if only is None else (only,)
            reflection.enable_server_reflection(
                (*named, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
            ports.append(self._bind(server, address))
            self._servers.append(server)
        for server in self._servers:
            server.start()
        self.port = ports[0]
        self.admin_port = ports[1] if len(ports) > 1 else None
        return self.port

    def _bind(self, server: Any, address: str) -> int:
        config = self.config
        try:
            if config.uses_tls:
                assert config.tls_cert is not None and config.tls_key is not None
                credentials = grpc.ssl_server_credentials(
                    [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
                )
                return int(server.add_secure_port(address, credentials))
            return int(server.add_insecure_port(address))
        except (RuntimeError, OSError) as exc:
            self._servers = []
            self._shutdown_pools(wait=False)
            raise ServeError(f"cannot listen on {address} ({exc}); is another "
                             "process using the port?") from exc

    def attach(self, engine: Engine, admin: CacheAdmin | None) -> None:
        """Serve with ``engine``, and the Admin service with ``admin`` (None: no cache), from
        now on: health SERVING, and NOT_SERVING (``engine_died`` set) if its worker dies."""
        self._engines.attach(engine, admin)
        for service in HEALTH_SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._stop_engine_watchdog()
        self._engine_watchdog = EngineWatchdog(lambda: engine.is_worker_dead,
                                               self._on_engine_death)
        self._engine_watchdog.start()

    def set_health(self, service: str, serving: bool) -> None:
        """Health of one more named service (e.g. ``EVICTIONS_HEALTH``), beside the gateway's."""
        self._health.set(service, health_pb2.HealthCheckResponse.SERVING if serving
                         else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _on_engine_death(self) -> None:
        for service in HEALTH_SERVICES:
            self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.engine_died.set()

    def _stop_engine_watchdog(self) -> None:
        watchdog, self._engine_watchdog = self._engine_watchdog, None
        if watchdog is not None:
            watchdog.stop()

    def begin_shutdown(self) -> threading.Event:
        """Health NOT_SERVING, refuse new calls; calls in flight go on for the grace period.

        Returns:
            An event set once every call has ended (at the latest after the grace period).
        """
        self._stop_engine_watchdog()
        self._health.enter_graceful_shutdown()
        events = [server.stop(self.config.grpc.shutdown_grace_s) for server in self._servers]
        done = threading.Event()

        def wait_all() -> None:
            for event in events:
                event.wait()
            done.set()

        threading.Thread(target=wait_all, name="kvgate-drain", daemon=True).start()
        return done

    def stop(self, grace_s: float | None = None) -> None:
        """Stop now (calls in flight get ``grace_s``, default none) and wait for it."""
        self._stop_engine_watchdog()
        self._health.enter_graceful_shutdown()
        for event in [server.stop(grace_s) for server in self._servers]:
            event.wait()
        self._servers = []
        self._shutdown_pools(wait=True)

    def _shutdown_pools(self, *, wait: bool) -> None:
        self._watchdog.stop()
        for pool in self._pools:
            pool.shutdown(wait=wait)
        self._pools = []
