"""The validated, frozen configuration of ``kvgate serve``: ``ServeConfig`` and its sections.

These are values only: ``gateway.config.loader`` builds them from a file, the environment and
the command line, and every layer above receives the one instance it builds. Each section
lists its own problems (``problems()``) so that the loader can report all of them at once.
The ``[engine]`` section is the engine's own record (``gateway.engine.settings.EngineSettings``,
its defaults and messages written there once); ``kvgate serve`` hands it to the engine as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from gateway.cache.config import CacheConfig
from gateway.config.events import EventsSettings
from gateway.config.keys import KeyEntry
from gateway.config.limits import LimitSettings
from gateway.engine.settings import EngineSettings as EngineSettings
from gateway.engine.settings import is_int as is_int
from gateway.engine.settings import is_positive as is_positive

MiB = 1 << 20
KiB = 1 << 10

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_DATA_DIR = Path("data")
DEFAULT_MODEL = "bundled"
DEFAULT_ADMIN_HOST = "127.0.0.1"
DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_METRICS_PORT = 9464
DEFAULT_HTTP_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
"""The port OpenAI-compatible servers (vLLM, ``transformers serve``) listen on by default, so
an SDK client's ``base_url`` of ``http://127.0.0.1:8000/v1`` finds kvgate there unchanged."""
DEV_KEY_FILE = "dev-api-key"
DEV_ADMIN_KEY_FILE = "dev-admin-key"
SECRET_FILE = "secret"


class ConfigError(ValueError):
    """The configuration cannot be used; the message lists every problem found."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcSettings:
    """The gRPC server's limits, set on purpose (docs/reliability.md, "gRPC server settings").

    Attributes:
        max_receive_bytes: largest request message; bigger ones get RESOURCE_EXHAUSTED before
            any handler runs.
        max_send_bytes: largest response message (ListPrefixes and Stats are the big ones).
        max_concurrent_streams: streams one HTTP/2 connection may open at once.
        body_timeout_s: a call must send its request message within this long of its
            headers, or it is cancelled and its worker thread freed (a call without a valid
            key holds no thread at all: it is refused on its headers).
        handshake_timeout_s: a new connection must finish its TLS and HTTP/2 handshake within
            this long.
        health_threads: worker threads of the health service, apart from the keyed calls'
            (health checks answer whatever the keyed calls are doing); more health calls at
            once get RESOURCE_EXHAUSTED.
        max_metadata_bytes: largest metadata (headers) a call may send.
        keepalive_time_s: how often the server pings an idle connection to see it is alive.
        keepalive_timeout_s: how long it waits for the answer before closing it.
        min_ping_interval_s: the shortest interval between client pings (without data) the
            server accepts; faster pings are strikes.
        max_ping_strikes: strikes before the server closes the connection (ping floods).
        max_connection_idle_s: close connections without calls after this long.
        max_connection_age_s: ask clients to reconnect after this long (spreads load over
            replicas as they come and go).
        max_connection_age_grace_s: how long calls in flight may still run after that.
        max_deadline_s: the longest a request may run, whatever deadline its client sent.
        max_ttl_s: the longest TTL a request may give its blocks.
        shutdown_grace_s: on SIGTERM, how long requests in flight may take to finish.
    """

    max_receive_bytes: int = 4 * MiB
    max_send_bytes: int = 16 * MiB
    max_concurrent_streams: int = 32
    body_timeout_s: float = 5.0
    handshake_timeout_s: float = 10.0
    health_threads: int = 4
    max_metadata_bytes: int = 16 * KiB
    keepalive_time_s: float = 60.0
    keepalive_timeout_s: float = 20.0
    min_ping_interval_s: float = 30.0
    max_ping_strikes: int = 2
    max_connection_idle_s: float = 300.0
    max_connection_age_s: float = 3600.0
    max_connection_age_grace_s: float = 600.0
    max_deadline_s: float = 600.0
    max_ttl_s: float = 7 * 24 * 3600.0
    shutdown_grace_s: float = 10.0

    def problems(self) -> list[str]:
        errors = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                errors.append(f"grpc.{f.name} must be a number, got {value!r}")
            elif not (math.isfinite(value) and value > 0):
                errors.append(f"grpc.{f.name} must be > 0, got {value!r}")
            elif f.type == "int" and not isinstance(value, int):
                errors.append(f"grpc.{f.name} must be an integer, got {value!r}")
        if not errors and self.max_connection_age_grace_s < self.max_deadline_s:
            errors.append("grpc.max_connection_age_grace_s must be >= grpc.max_deadline_s, so "
                          "that a connection's age never cuts a request short")
        return errors

    def server_options(self) -> list[tuple[str, int]]:
        """The ``grpc.server(options=...)`` list for these settings."""

        def ms(seconds: float) -> int:
            return int(seconds * 1000)

        return [
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.max_send_message_length", self.max_send_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)),
            ("grpc.max_metadata_size", self.max_metadata_bytes),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time_s)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout_s)),
            # A client pinging without calls gets strikes; with calls, min_ping_interval.
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 2),
            ("grpc.http2.min_ping_interval_without_data_ms", ms(self.min_ping_interval_s)),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
            ("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s)),
            ("grpc.max_connection_age_ms", ms(self.max_connection_age_s)),
            ("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace_s)),
            # NOTE: on by default on Linux: a second gateway could silently share the port.
            ("grpc.so_reuseport", 0),
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoggingSettings:
    """What the gateway logs besides its own events (docs/operations.md, "Logs").

    Attributes:
        access_log: one line per finished request on the ``kvgate.access`` logger (tenant, API,
            tokens, TTFT, total, status; never prompt text or keys).
        stats_interval_s: every this many seconds, one line of throughput, hit ratio, queue and
            KV memory on the ``kvgate.stats`` logger, when anything happened; 0 turns it off.
        json: write both as one JSON object per line instead of ``key=value`` pairs.
    """

    access_log: bool = True
    stats_interval_s: float = 10.0
    json: bool = False

    def problems(self) -> list[str]:
        errors = []
        for name in ("access_log", "json"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"logging.{name} must be true or false, got "
                              f"{getattr(self, name)!r}")
        interval = self.stats_interval_s
        if isinstance(interval, bool) or (interval != 0 and not is_positive(interval)):
            errors.append(f"logging.stats_interval_s must be a number of seconds > 0, or 0 "
                          f"(no stats line), got {interval!r}")
        return errors


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSettings:
    """The Prometheus endpoint with every series (``gateway.service.metrics``), on a port of
    its own.

    Off by default: it shows per-tenant counters, so an operator turns it on and decides who
    can reach it. The API port's ``GET /metrics`` (``[http] metrics``, on by default) serves
    the same series without the per-tenant ones. Both are open unless a scrape token is set
    (``gateway.service.scrape_token``).

    Attributes:
        enabled: serve ``/metrics`` over HTTP.
        host: where to listen (loopback by default; a scraper elsewhere needs a routable one).
        port: the port (0 picks a free one, logged at start).
        scrape_token_file: a file holding the token that both ``/metrics`` then require as
            ``Authorization: Bearer <token>`` (``KVGATE_METRICS_TOKEN`` or
            ``KVGATE_METRICS_TOKEN_FILE`` win over it); None: no token, both open.
        scrape_token_digest: the token's ``key_digest``, read by the loader from the file or
            the environment (never set in a config file); None: no token.
    """

    enabled: bool = False
    host: str = DEFAULT_METRICS_HOST
    port: int = DEFAULT_METRICS_PORT
    scrape_token_file: Path | None = None
    scrape_token_digest: bytes | None = None

    def problems(self) -> list[str]:
        errors = []
        if not isinstance(self.enabled, bool):
            errors.append(f"metrics.enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.host, str) or not self.host:
            errors.append(f"metrics.host must be a host name or address, got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            errors.append(f"metrics.port must be 0 to 65535, got {self.port!r}")
        return errors


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpSettings:
    """The OpenAI-compatible HTTP front (``gateway.service.http``), on a port of its own.

    It is served by the same engine, keys, limits and metrics as gRPC, with the same TLS
    certificate (``[server] tls_cert``/``tls_key``) and the same rule: plaintext only on
    loopback unless ``allow_insecure_remote``.

    Attributes:
        enabled: serve it.
        host: where to listen.
        port: the port (0 picks a free one, logged at start).
        max_body_bytes: largest request body; a bigger one gets 413 before it is read whole
            (the Content-Length is checked first, a chunked body as it arrives).
        max_connections: connections at once, set far above what the engine admits (the
            per-key limits, checked after the key, are the real admission). One more closes
            the connection that has waited longest for a request, or itself when every
            connection has a request in flight; never a 503 to a request. Lowered at start
            to half the process's open-file limit, so that the gRPC front, the tiers and
            Redis keep descriptors whatever the HTTP clients do.
        max_waiting_connections: connections at once that have not sent a whole request
            head (new ones, and kept-alive ones between requests): nothing is known about
            them yet, not even a key, so they get a small share; one more closes the one
            that has waited longest. At most ``max_connections``.
        header_timeout_s: a connection must send a whole request head within this long of
            connecting or of its previous answer (an idle keep-alive), or it is closed.
        body_timeout_s: a request must send its whole body within this long of its head
            (as ``[grpc] body_timeout_s``): 408 and the connection closed. A request holds
            no call slot until its body is in.
        max_pending_bodies_per_tenant: request bodies one tenant may be sending at once (its
            keys together); one more gets 429 before its body is read, so that one tenant's
            slow or stalled bodies cannot hold the connections other tenants need.
        retry_after_s: the ``Retry-After`` seconds of a 429 or 503 answer.
        metrics: serve ``GET /metrics`` here, without per-tenant series (``[metrics]`` serves
            every series on a port of its own), open unless ``[metrics]`` sets a scrape token.
        served_model_name: the model ids the API answers to, as vLLM's
            ``--served-model-name``: the first is the one ``/v1/models``, ``/health`` and every
            response report (and the ``model_name`` label of the ``vllm:*`` series); a request
            may name any of them. Empty (the default): the ``--model`` directory's name (or
            ``bundled``), and the ``--model`` value itself.
        session_from_user: a request's ``user`` field names its session too (as the
            ``X-Session-Id`` header does, which wins where both are sent): for apps that send
            one ``user`` per conversation. Off by default: ``user`` is often a person, whose
            conversations are many.
        max_stored_responses_per_tenant: responses (``POST /v1/responses`` with ``store``)
            one tenant keeps for ``previous_response_id`` and ``GET``, in this replica's
            memory; one more drops the tenant's least recently used. Each is kept
            ``[engine] default_ttl_s`` after its last use (a day with
            ``prompt_cache_retention: "24h"``).
        max_stored_response_chars_per_tenant: characters of stored conversations (answers
            included) one tenant keeps; past it, its least recently used responses are
            dropped (a conversation may be as long as a prompt, so the count alone would let
            one tenant hold gigabytes).
    """

    enabled: bool = True
    host: str = DEFAULT_HTTP_HOST
    port: int = DEFAULT_HTTP_PORT
    max_body_bytes: int = 4 * MiB
    max_connections: int = 1024
    max_waiting_connections: int = 256
    header_timeout_s: float = 5.0
    body_timeout_s: float = 5.0
    max_pending_bodies_per_tenant: int = 16
    retry_after_s: int = 1
    metrics: bool = True
    served_model_name: tuple[str, ...] = ()
    session_from_user: bool = False
    max_stored_responses_per_tenant: int = 1000
    max_stored_response_chars_per_tenant: int = 64 * MiB

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def problems(self) -> list[str]:
        errors = []
        for name in ("enabled", "metrics", "session_from_user"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"http.{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.host, str) or not self.host:
            errors.append(f"http.host must be a host name or address, got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            errors.append(f"http.port must be 0 to 65535, got {self.port!r}")
        for name in ("max_body_bytes", "max_connections", "max_waiting_connections",
                     "max_pending_bodies_per_tenant", "retry_after_s",
                     "max_stored_responses_per_tenant",
                     "max_stored_response_chars_per_tenant"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                errors.append(f"http.{name} must be an integer >= 1, got {value!r}")
        for name in ("header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not is_positive(value):
                errors.append(f"http.{name} must be a number of seconds > 0, got {value!r}")
        if not errors and self.max_waiting_connections > self.max_connections:
            errors.append("http.max_waiting_connections must be <= http.max_connections")
        names = self.served_model_name
        if not isinstance(names, tuple) or not all(
                isinstance(name, str) and name.strip() == name and name for name in names):
            errors.append("http.served_model_name must be a model id or a list of them, each "
                          f"non-empty and without surrounding spaces, got {names!r}")
        elif len(set(names)) != len(names):
            errors.append(f"http.served_model_name names a model id twice: {list(names)}")
        return errors


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """Everything ``kvgate serve`` needs, validated.

    Attributes:
        host, port: where to listen (port 0 picks a free one).
        data_dir: disk tier (``kv/``), model cache (``models/``), secret, dev key.
        model: ``bundled`` or a checkpoint directory.
        tls_cert, tls_key: PEM files; both or neither.
        allow_insecure_remote: listen on a non-loopback host without TLS (API keys then travel
            in the clear: only behind a TLS-terminating proxy on a private network).
        secret_file: the deployment secret (default ``data_dir/secret``).
        admin_host, admin_port: a listener of its own for the Admin service (so that a network
            policy can keep it from the apps that reach the Gateway service); None: the Admin
            service is served on the main listener.
        keys: every configured API key (tenant and admin).
        grpc, engine, cache, metrics, http, limits, logging, events: the sections of the same
            names.
        device: where the model and the device tier live: "auto", "cpu", "cuda", "cuda:N"
            (``gateway.config.device``).
        dtype: what the model computes and the cache stores K/V in: "auto" (bfloat16 on a GPU,
            float32 on the CPU), "float32", "bfloat16", "float16" (``gateway.config.dtype``);
            part of every block's namespace.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path = DEFAULT_DATA_DIR
    model: str = DEFAULT_MODEL
    tls_cert: Path | None = None
    tls_key: Path | None = None
    allow_insecure_remote: bool = False
    secret_file: Path | None = None
    admin_host: str = DEFAULT_ADMIN_HOST
    admin_port: int | None = None
    keys: tuple[KeyEntry, ...] = ()
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    cache: CacheConfig = field(default_factory=CacheConfig)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    http: HttpSettings = field(default_factory=HttpSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    events: EventsSettings = field(default_factory=EventsSettings)
    # -- lifecycle and reach (issue 11) --
    device: str = "auto"
    # -- numerics for a GPU (issue 14) --
    dtype: str = "auto"

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def admin_address(self) -> str | None:
        """The Admin service's own listener, or None (it is on ``address``)."""
        if self.admin_port is None:
            return None
        host = f"[{self.admin_host}]" if ":" in self.admin_host else self.admin_host
        return f"{host}:{self.admin_port}"

    @property
    def uses_tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def secret_path(self) -> Path:
        return self.secret_file if self.secret_file is not None else self.data_dir / SECRET_FILE

    @property
    def dev_key_path(self) -> Path:
        return self.data_dir / DEV_KEY_FILE

    @property
    def dev_admin_key_path(self) -> Path:
        return self.data_dir / DEV_ADMIN_KEY_FILE
