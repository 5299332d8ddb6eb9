"""The HTTP front's listener: uvicorn on a thread of its own, beside the gRPC server.

``HttpFront`` binds its socket itself (so a busy port is a ``ServeError`` at start, and port 0
gives the bound port at once), then runs ``uvicorn.Server`` on a daemon thread with its own
event loop. Like the gRPC server it listens before the model is loaded: ``/health`` says 503
(loading) and every API call 503 until the composition root attaches the engine to the shared
``EngineSlot``.

uvicorn is configured on purpose: no logging configuration of its own and no access log of its
own (the gateway's logging stays the operator's; the front writes its own access line, with the
tenant and token counts uvicorn's cannot know, on ``kvgate.access``), no lifespan, no
WebSockets, no ``Server`` header, the same TLS certificate as gRPC, and a graceful shutdown that
lets requests in flight finish within the gRPC grace period. Its h11 protocol is
``GuardedH11Protocol`` (``connections``): deadlines for a request head and body, and caps on
connections sized under the process's open-file limit. Headers are bounded by h11 (16 KiB);
bodies by the front (``[http] max_body_bytes``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import threading
import time
from functools import partial
from typing import Any

import uvicorn
from prometheus_client.registry import CollectorRegistry

from gateway.config.settings import ServeConfig
from gateway.core.prompt_limits import PromptLimits
from gateway.service.access_log import AccessLog
from gateway.service.admission import Admission
from gateway.service.auth import Authenticator
from gateway.service.edge import EdgeLimits
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.accept_errors import AcceptErrorLog
from gateway.service.http.app import OpenAIFront
from gateway.service.http.connections import (
    ConnectionGuard,
    GuardedH11Protocol,
    limits_within,
    open_file_limit,
)
from gateway.service.http.disk_responses import DiskResponses
from gateway.service.http.redis_responses import RedisResponses
from gateway.service.http.response_seal import responses_mac_key
from gateway.service.http.stored_responses import MemoryResponses, ResponseStore
from gateway.service.prompt_comparisons import PromptComparisons
from gateway.service.scrape_token import scrape_token_of
from gateway.service.server import ServeError, check_plaintext_listener
from tiers.redis_client import build_client, close_client

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


class HttpFront:
    """The OpenAI-compatible API on ``config.http``'s address.

    Args:
        config: ``config.http`` (address, limits), the TLS files and the gRPC deadline/TTL
            bounds (``config.grpc``), which both surfaces enforce alike.
        authenticator: the keys (the gRPC server's).
        engines: the slot the gRPC server shares.
        admission: the per-key call limits shared with the gRPC server.
        metrics: the registry ``GET /metrics`` serves when ``[http] metrics`` is on; it must
            hold no per-tenant series (``GatewayMetrics.public_registry``).
        comparisons: the shapes of recent requests, shared with the gRPC server (None: this
            front's own, of ``[cache] block_tokens``).

    Attributes:
        guard: the connections' states and counts, once started (for tests and stats).
    """

    def __init__(self, config: ServeConfig, authenticator: Authenticator,
                 engines: EngineSlot, admission: Admission | None = None,
                 metrics: CollectorRegistry | None = None,
                 deployment_secret: bytes | None = None,
                 comparisons: PromptComparisons | None = None) -> None:
        self.config = config
        settings = config.http
        self._redis: Any = None
        responses: ResponseStore = MemoryResponses(
            max_per_tenant=settings.max_stored_responses_per_tenant,
            max_chars_per_tenant=settings.max_stored_response_chars_per_tenant,
            default_ttl_s=config.engine.default_ttl_s)
        if config.cache.redis_url and deployment_secret is not None:
            responses = self._redis_responses(config, deployment_secret)
        elif config.cache.disk_bytes and deployment_secret is not None:
            responses = DiskResponses(
                config.data_dir / "responses", mac_key=responses_mac_key(deployment_secret),
                max_per_tenant=settings.max_stored_responses_per_tenant,
                max_chars_per_tenant=settings.max_stored_response_chars_per_tenant,
                default_ttl_s=config.engine.default_ttl_s)
        self._front = OpenAIFront(
            engines, authenticator,
            EdgeLimits(max_deadline_s=config.grpc.max_deadline_s,
                       max_ttl_s=config.grpc.max_ttl_s,
                       prompt=PromptLimits(max_chars=config.limits.max_prompt_chars,
                                           max_messages=config.limits.max_messages)),
            max_body_bytes=settings.max_body_bytes, max_threads=settings.max_connections,
            retry_after_s=settings.retry_after_s, body_timeout_s=settings.body_timeout_s,
            max_pending_bodies_per_tenant=settings.max_pending_bodies_per_tenant,
            admission=admission,
            access=AccessLog(is_enabled=config.logging.access_log, is_json=config.logging.json),
            metrics=metrics if settings.metrics else None,
            scrape_token=scrape_token_of(config.metrics),
            served_model_name=settings.served_model_name,
            session_from_user=settings.session_from_user,
            responses=responses,
            comparisons=(comparisons if comparisons is not None
                         else PromptComparisons(block_tokens=config.cache.block_tokens)),
        )
        self.guard: ConnectionGuard | None = None
        self.accept_errors: AcceptErrorLog | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        """The API's base URL (what an OpenAI SDK client takes as ``base_url``)."""
        scheme = "https" if self.config.uses_tls else "http"
        host = self.config.http.host
        host = f"[{host}]" if ":" in host else host
        return f"{scheme}://{host}:{self.port}/v1"

    def start(self) -> int:
        """Listen and serve (503 until an engine is attached); returns the bound port.

        Raises:
            ServeError: a plaintext non-loopback listener without ``allow_insecure_remote``,
                the address cannot be bound, or the server did not come up.
        """
        settings = self.config.http
        check_plaintext_listener(self.config, settings.host, settings.address)
        sock = _bind(settings.host, settings.port)
        cert, key = self.config.tls_cert, self.config.tls_key
        guard = ConnectionGuard(limits_within(settings, open_file_limit()))
        uv_config = uvicorn.Config(
            self._front.app(), log_config=None, access_log=False, lifespan="off", ws="none",
            # NOTE: uvicorn calls ``http`` with keyword arguments: any callable will do.
            http=partial(GuardedH11Protocol, guard=guard,  # type: ignore[arg-type]
                         grpc_port=self.config.port or None),
            loop="asyncio", server_header=False,
            # The guard keeps connections under max_connections without refusing requests;
            # this only bounds request tasks that outlive their connections.
            limit_concurrency=2 * guard.limits.max_connections,
            timeout_keep_alive=math.ceil(settings.header_timeout_s),
            timeout_graceful_shutdown=int(self.config.grpc.shutdown_grace_s) + 1,
            ssl_certfile=str(cert) if cert is not None else None,
            ssl_keyfile=str(key) if key is not None else None,
        )
        server = uvicorn.Server(uv_config)
        self.accept_errors = AcceptErrorLog()
        thread = threading.Thread(target=_serve, args=(server, sock, self.accept_errors),
                                  name="kvgate-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise ServeError(f"the HTTP front did not start on {settings.address}")
            time.sleep(0.01)
        self._server, self._thread, self.guard = server, thread, guard
        self.port = int(sock.getsockname()[1])
        return self.port

    def num_accept_errors(self) -> int:
        """Connections not accepted for want of descriptors since start (0 before start)."""
        return self.accept_errors.num_failed if self.accept_errors is not None else 0

    def begin_shutdown(self) -> None:
        """Refuse new requests (503) and stop listening; requests in flight go on."""
        self._front.begin_shutdown()
        if self._server is not None:
            self._server.should_exit = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop (requests in flight get what is left of the graceful shutdown) and wait."""
        self.begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout=5.0)
            self._thread = None
        self._server = None
        if self._redis is not None:
            close_client(self._redis)
            self._redis = None

    def _redis_responses(self, config: ServeConfig, deployment_secret: bytes) -> ResponseStore:
        """Stored responses in the cache's Redis, for every replica (``RedisResponses``)."""
        cache, settings = config.cache, config.http
        assert cache.redis_url is not None
        self._redis = build_client(cache.redis_url, cluster=cache.redis_cluster,
                                   socket_timeout_s=cache.redis_timeout_s,
                                   connect_timeout_s=cache.redis_timeout_s)
        return RedisResponses(self._redis, key_prefix=cache.redis_key_prefix,
                              mac_key=responses_mac_key(deployment_secret),
                              max_per_tenant=settings.max_stored_responses_per_tenant,
                              max_chars_per_tenant=settings.max_stored_response_chars_per_tenant,
                              default_ttl_s=config.engine.default_ttl_s)


def _serve(server: uvicorn.Server, sock: socket.socket, accept_errors: AcceptErrorLog) -> None:
    """``server.run`` (uvicorn's), on a loop whose exception handler is ``accept_errors``."""

    async def serve() -> None:
        asyncio.get_running_loop().set_exception_handler(accept_errors)
        await server.serve(sockets=[sock])

    asyncio.run(serve())


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: uvicorn's loop does that)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ServeError(f"cannot listen for HTTP on {host}:{port} ({exc})") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen for HTTP on {host}:{port} ({exc}); is another "
                         "process using the port? ([http] port, --http-port)") from exc
    return sock
