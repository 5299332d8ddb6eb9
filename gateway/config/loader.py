"""What ``kvgate serve`` runs with: one validated, frozen ``ServeConfig``.

Sources, later ones winning: the defaults here, a TOML or JSON file (``--config``), the
environment (``KVGATE_API_KEYS``, ``KVGATE_ADMIN_KEYS``: keys are added to the file's), and the
command line (``--host``, ``--port``, ``--data-dir``, ``--model``). Every problem is reported
at once, before anything starts, with the file's own names::

    [server]
    host = "127.0.0.1"            # a non-loopback host needs TLS (or allow_insecure_remote)
    port = 50051
    data_dir = "data"             # kv/ (disk tier), models/, secret, dev-api-key
    model = "bundled"             # or a transformers checkpoint directory
    tls_cert = "/etc/kvgate/tls.crt"
    tls_key = "/etc/kvgate/tls.key"

    [grpc]                        # GrpcSettings: limits, keepalive, deadlines
    max_concurrent_rpcs = 64

    [engine]                      # EngineSettings
    max_queue = 64

    [cache]                       # gateway.cache.factory.CacheConfig; sizes as bytes or "2GiB"
    host_bytes = "4GiB"
    quotas = { tenant-a = "1GiB" }

    [metrics]                     # MetricsSettings: Prometheus endpoint, off by default
    enabled = true
    port = 9464

    [[api_keys]]                  # key = "..." or key_blake2b = "<hex of auth.key_digest(key)>"
    tenant = "tenant-a"
    key_blake2b = "3f1c..."

    [[admin_keys]]
    name = "ops"
    key = "..."

The data directory also keeps what must survive restarts: the deployment secret (``secret``,
0600; it keys every block hash and MAC, so disk blocks stay valid only with the same secret)
and, when no key is configured, a development key for tenant ``default`` (``dev-api-key``).
"""

from __future__ import annotations

import binascii
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from gateway.cache.factory import CacheConfig, GiB
from gateway.config.keys import (
    DEFAULT_ADMIN_NAME,
    KeyEntry,
    key_problem,
    parse_key_list,
    tenant_id_problem,
    tenants_without_keys,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
KiB = 1 << 10

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_DATA_DIR = Path("data")
DEFAULT_MODEL = "bundled"
DEFAULT_DISK_BYTES = 8 * GiB
DEFAULT_METRICS_HOST = "127.0.0.1"
DEFAULT_METRICS_PORT = 9464
DEV_TENANT = "default"
DEV_KEY_FILE = "dev-api-key"
SECRET_FILE = "secret"
SECRET_BYTES = 32

ENV_API_KEYS = "KVGATE_API_KEYS"
ENV_ADMIN_KEYS = "KVGATE_ADMIN_KEYS"
ENV_SECRET = "KVGATE_DEPLOYMENT_SECRET"
ENV_REDIS_URL = "KVGATE_REDIS_URL"
"""Overrides ``[cache] redis_url``, so that a Redis password need not sit in the config file."""
"""Hex of the deployment secret; replicas sharing a Redis tier must all use the same one."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1000, "kib": KiB, "mb": 1000**2, "mib": MiB, "gb": 1000**3, "gib": GiB,
          "tb": 1000**4, "tib": 1 << 40}


class ConfigError(ValueError):
    """The configuration cannot be used; the message lists every problem found."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcSettings:
    """The gRPC server's limits, set on purpose (RELIABILITY.md, "gRPC server settings").

    Attributes:
        max_receive_bytes: largest request message; bigger ones get RESOURCE_EXHAUSTED before
            any handler runs.
        max_send_bytes: largest response message (ListPrefixes and Stats are the big ones).
        max_concurrent_rpcs: RPCs served at once (one thread each); more get
            RESOURCE_EXHAUSTED at once instead of queueing without bound.
        max_concurrent_streams: streams one HTTP/2 connection may open at once.
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
    max_concurrent_rpcs: int = 64
    max_concurrent_streams: int = 32
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
class EngineSettings:
    """The engine's settings that are not shared with the cache or the gRPC limits.

    ``block_tokens`` comes from ``[cache]`` and ``max_deadline_s`` from ``[grpc]``, so that the
    two places that need them cannot disagree.

    Attributes:
        max_queue: requests waiting for the model; more get RESOURCE_EXHAUSTED.
        default_ttl_s: TTL of blocks whose request sent none (None: no expiry).
        max_prompt_tokens: longest prompt accepted (None: the model's context minus 1).
    """

    max_queue: int = 64
    default_ttl_s: float | None = 3600.0
    max_prompt_tokens: int | None = None

    def problems(self) -> list[str]:
        errors = []
        if not _is_int(self.max_queue) or self.max_queue < 1:
            errors.append(f"engine.max_queue must be an integer >= 1, got {self.max_queue!r}")
        if self.default_ttl_s is not None and not _is_positive(self.default_ttl_s):
            errors.append(f"engine.default_ttl_s must be > 0, got {self.default_ttl_s!r}")
        if self.max_prompt_tokens is not None and (
            not _is_int(self.max_prompt_tokens) or self.max_prompt_tokens < 1
        ):
            errors.append("engine.max_prompt_tokens must be an integer >= 1, got "
                          f"{self.max_prompt_tokens!r}")
        return errors


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSettings:
    """The Prometheus endpoint (``gateway.service.metrics``), on a port of its own.

    Off by default: it has no authentication and shows per-tenant counters, so an operator
    turns it on and decides who can reach it.

    Attributes:
        enabled: serve ``/metrics`` over HTTP.
        host: where to listen (loopback by default; a scraper elsewhere needs a routable one).
        port: the port (0 picks a free one, logged at start).
    """

    enabled: bool = False
    host: str = DEFAULT_METRICS_HOST
    port: int = DEFAULT_METRICS_PORT

    def problems(self) -> list[str]:
        errors = []
        if not isinstance(self.enabled, bool):
            errors.append(f"metrics.enabled must be true or false, got {self.enabled!r}")
        if not isinstance(self.host, str) or not self.host:
            errors.append(f"metrics.host must be a host name or address, got {self.host!r}")
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            errors.append(f"metrics.port must be 0 to 65535, got {self.port!r}")
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
        keys: every configured API key (tenant and admin).
        grpc, engine, cache, metrics: the sections of the same names.
    """

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    data_dir: Path = DEFAULT_DATA_DIR
    model: str = DEFAULT_MODEL
    tls_cert: Path | None = None
    tls_key: Path | None = None
    allow_insecure_remote: bool = False
    secret_file: Path | None = None
    keys: tuple[KeyEntry, ...] = ()
    grpc: GrpcSettings = field(default_factory=GrpcSettings)
    engine: EngineSettings = field(default_factory=EngineSettings)
    cache: CacheConfig = field(default_factory=CacheConfig)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def uses_tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def secret_path(self) -> Path:
        return self.secret_file if self.secret_file is not None else self.data_dir / SECRET_FILE

    @property
    def dev_key_path(self) -> Path:
        return self.data_dir / DEV_KEY_FILE


_SERVER_KEYS = frozenset(
    {"host", "port", "data_dir", "model", "tls_cert", "tls_key", "allow_insecure_remote",
     "secret_file"}
)
_SECTIONS = frozenset({"server", "grpc", "engine", "cache", "metrics", "api_keys",
                       "admin_keys"})
_SIZE_KEYS = frozenset({"device_bytes", "host_bytes", "disk_bytes"})


EXAMPLE_CONFIG = """\
# kvgate serve --config kvgate.toml
#
# Every key is optional: what is left out keeps the default shown. Environment variables
# add keys (KVGATE_API_KEYS, KVGATE_ADMIN_KEYS) and set the deployment secret
# (KVGATE_DEPLOYMENT_SECRET, hex); --host, --port, --data-dir and --model override [server].
# Sizes are bytes or strings such as "512MiB" or "2GB". Every problem is reported at once.

[server]
host = "127.0.0.1"              # a non-loopback host needs TLS (or allow_insecure_remote)
port = 50051
data_dir = "data"               # kv/ (disk tier), models/, secret, dev-api-key
model = "bundled"               # SmolLM2-135M-Instruct, or a transformers checkpoint directory
# tls_cert = "/etc/kvgate/tls.crt"   # PEM; give both or neither
# tls_key = "/etc/kvgate/tls.key"
# allow_insecure_remote = false      # plaintext on a non-loopback host (behind a TLS proxy)
# secret_file = "/etc/kvgate/secret" # default: data_dir/secret, created on first start

[grpc]                          # limits of the gRPC server
max_receive_bytes = 4194304     # bigger requests: RESOURCE_EXHAUSTED before any handler
max_concurrent_rpcs = 64        # more at once: RESOURCE_EXHAUSTED instead of queueing
max_deadline_s = 600.0          # the longest a request may run, whatever its client asks
max_ttl_s = 604800.0            # the longest TTL a request may give its blocks
shutdown_grace_s = 10.0         # on SIGTERM, time for requests in flight to finish

[engine]
max_queue = 64                  # requests waiting for the model; more are refused
default_ttl_s = 3600.0          # TTL of blocks whose request names none
# max_prompt_tokens = 8191      # default: the model's context minus 1

[cache]
block_tokens = 256              # tokens per block: the unit of storage and sharing
order = "lru"                   # eviction order of every tier: "lru" or "clock"
device_bytes = "2GiB"           # GPU memory (CPU memory without a GPU); 0 turns a tier off
host_bytes = "4GiB"             # CPU memory
disk_bytes = "8GiB"             # under disk_path (default: data_dir/kv), meant for local NVMe
disk_fsync = true
disk_write_through = true       # new blocks go to disk at once (off the request path)
# redis_url = "rediss://kvgate:PASSWORD@redis.internal:6379/0"  # shared by replicas
# redis_cluster = false
redis_ttl_s = 3600.0
redis_timeout_s = 0.25          # the most a stalled Redis adds to a request
compression = "raw"             # "raw", "lz4" or "auto"
# quotas = { tenant-a = "1GiB", tenant-b = "512MiB" }

[metrics]                       # Prometheus endpoint: http://HOST:PORT/metrics
enabled = false                 # no authentication, per-tenant series: operators only
host = "127.0.0.1"
port = 9464

# API keys: a tenant's key sees only that tenant's cache. Give `key` (the key itself) or
# `key_blake2b` (hex of gateway.config.keys.key_digest(key)) so that the file holds no secret.
# Without any key, serve creates a development key for tenant "default".
# [[api_keys]]
# tenant = "tenant-a"
# key_blake2b = "<hex digest>"
#
# [[admin_keys]]                # the Admin service (stats, evict, pin, quota, flush)
# name = "ops"
# key_blake2b = "<hex digest>"
"""
"""The commented example of ``kvgate config example`` (and ``deploy/kvgate.example.toml``)."""


def load_serve_config(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> ServeConfig:
    """Read, merge and validate the configuration.

    Args:
        path: a ``.toml`` or ``.json`` file, or None for the defaults.
        env: the environment (``os.environ``); only ``KVGATE_*`` keys are read.
        overrides: ``[server]`` values from the command line (``None`` values are ignored).

    Raises:
        ConfigError: every problem found, in one message. Keys never appear in it.
    """
    raw = _read_file(path) if path is not None else {}
    where = str(path) if path is not None else "the configuration"
    errors: list[str] = []
    unknown = sorted(set(raw) - _SECTIONS)
    if unknown:
        errors.append(f"{where} has unknown sections {unknown}; known: {sorted(_SECTIONS)}")

    server = dict(_table(raw, "server", errors))
    for name, value in (overrides or {}).items():
        if value is not None:
            server[name] = value
    _unknown_keys("server", server, _SERVER_KEYS, errors)

    grpc_settings = _build(GrpcSettings, "grpc", _table(raw, "grpc", errors), errors)
    engine = _build(EngineSettings, "engine", _table(raw, "engine", errors), errors)
    metrics = _build(MetricsSettings, "metrics", _table(raw, "metrics", errors), errors)
    if grpc_settings is not None:
        errors.extend(grpc_settings.problems())
    if engine is not None:
        errors.extend(engine.problems())
    errors.extend(metrics.problems())

    data_dir = Path(str(server.get("data_dir", DEFAULT_DATA_DIR))).expanduser()
    environment = env or {}
    cache_table = dict(_table(raw, "cache", errors))
    if environment.get(ENV_REDIS_URL):
        cache_table["redis_url"] = environment[ENV_REDIS_URL]
    cache = _cache_config(cache_table, data_dir, errors)
    keys = _keys(raw, environment, errors)

    host = server.get("host", DEFAULT_HOST)
    if not isinstance(host, str) or not host:
        errors.append(f"server.host must be a host name or address, got {host!r}")
    port = server.get("port", DEFAULT_PORT)
    if not _is_int(port) or not 0 <= port <= 65535:
        errors.append(f"server.port must be 0 to 65535, got {port!r}")
    model = server.get("model", DEFAULT_MODEL)
    if not isinstance(model, str) or not model:
        errors.append(f"server.model must be 'bundled' or a directory, got {model!r}")
    tls_cert = _optional_path(server.get("tls_cert"))
    tls_key = _optional_path(server.get("tls_key"))
    if (tls_cert is None) != (tls_key is None):
        errors.append("server.tls_cert and server.tls_key go together: give both or neither")
    for name, tls_path in (("tls_cert", tls_cert), ("tls_key", tls_key)):
        if tls_path is not None and not tls_path.is_file():
            errors.append(f"server.{name} {tls_path} is not a file")
    allow_insecure = server.get("allow_insecure_remote", False)
    if not isinstance(allow_insecure, bool):
        errors.append("server.allow_insecure_remote must be true or false")

    if errors:
        raise ConfigError("invalid kvgate configuration:\n  - " + "\n  - ".join(errors))
    assert grpc_settings is not None and engine is not None and cache is not None
    strays = tenants_without_keys(keys, cache.quotas) if keys else []
    if strays:
        logger.warning("quotas are set for tenants that no key authenticates (typos?): %s",
                       ", ".join(strays))
    return ServeConfig(
        host=str(host), port=int(port), data_dir=data_dir, model=str(model),
        tls_cert=tls_cert, tls_key=tls_key, allow_insecure_remote=bool(allow_insecure),
        secret_file=_optional_path(server.get("secret_file")),
        keys=tuple(keys), grpc=grpc_settings, engine=engine, cache=cache, metrics=metrics,
    )


def parse_size(value: object) -> int:
    """Bytes from an integer or a string such as ``"512MiB"`` or ``"2 GB"``.

    Raises:
        ValueError: not a size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            unit = (match.group(2) or "b").lower()
            return int(float(match.group(1)) * _UNITS[unit])
    raise ValueError(f"{value!r} is not a size: write bytes (1073741824) or e.g. \"1GiB\"")


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc.strerror}") from exc
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    elif path.suffix == ".toml":
        data = _parse_toml(text, path)
    else:
        raise ConfigError(f"the configuration {path} must be a .toml or .json file")
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a table (object) of sections")
    return data


def _parse_toml(text: str, path: Path) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError as exc:  # Python 3.10
        raise ConfigError(f"{path}: TOML needs Python 3.11 or later; write the configuration "
                          "as JSON instead") from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def _table(raw: Mapping[str, Any], name: str, errors: list[str]) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        errors.append(f"[{name}] must be a table")
        return {}
    return value


def _unknown_keys(section: str, table: Mapping[str, Any], known: frozenset[str],
                  errors: list[str]) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        errors.append(f"[{section}] has unknown keys {unknown}; known: {sorted(known)}")


def _build(cls: Any, section: str, table: Mapping[str, Any], errors: list[str]) -> Any:
    known = frozenset(f.name for f in fields(cls))
    _unknown_keys(section, table, known, errors)
    return cls(**{k: v for k, v in table.items() if k in known})


def _cache_config(table: Mapping[str, Any], data_dir: Path,
                  errors: list[str]) -> CacheConfig | None:
    known = frozenset(f.name for f in fields(CacheConfig))
    _unknown_keys("cache", table, known, errors)
    values: dict[str, Any] = {"disk_bytes": DEFAULT_DISK_BYTES, "disk_path": data_dir / "kv"}
    for name, value in table.items():
        if name not in known:
            continue
        try:
            if name in _SIZE_KEYS:
                value = parse_size(value)
            elif name == "quotas":
                if not isinstance(value, dict):
                    raise ValueError("quotas must be a table of tenant = size")
                value = {str(tenant): parse_size(size) for tenant, size in value.items()}
            elif name == "disk_path":
                value = Path(str(value)).expanduser()
        except ValueError as exc:
            errors.append(f"cache.{name}: {exc}")
            continue
        values[name] = value
    for tenant in values.get("quotas", {}):
        problem = tenant_id_problem(tenant)
        if problem is not None:
            errors.append(f"cache.quotas: {problem}")
    try:
        config = CacheConfig(**values)
    except (ValueError, TypeError) as exc:
        errors.append(f"[cache]: {exc}")
        return None
    errors.extend(machine_fit_problems(config))
    return config


def machine_fit_problems(config: CacheConfig) -> list[str]:
    """Budgets this machine cannot hold: memory tiers beyond its RAM, disk beyond its disk.

    A budget is a promise the policies keep; one larger than the machine ends with the OOM
    killer or a full disk instead of an eviction.
    """
    problems = []
    memory = physical_memory_bytes()
    in_ram = config.host_bytes + (0 if _has_cuda() else config.device_bytes)
    if memory is not None and in_ram > memory:
        what = "host_bytes" if _has_cuda() else "device_bytes + host_bytes"
        problems.append(
            f"cache.{what} = {_gib(in_ram)} is more than this machine's memory "
            f"({_gib(memory)}); lower it"
        )
    if config.disk_bytes and config.disk_path is not None:
        existing = config.disk_path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        try:
            total = shutil.disk_usage(existing).total
        except OSError:
            total = None
        if total is not None and config.disk_bytes > total:
            problems.append(
                f"cache.disk_bytes = {_gib(config.disk_bytes)} is more than the filesystem of "
                f"{config.disk_path} holds ({_gib(total)}); lower it"
            )
    return problems


def physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB"


def _keys(raw: Mapping[str, Any], env: Mapping[str, str], errors: list[str]) -> list[KeyEntry]:
    entries: list[KeyEntry] = []
    for section, is_admin in (("api_keys", False), ("admin_keys", True)):
        items = raw.get(section, [])
        if not isinstance(items, list):
            errors.append(f"[[{section}]] must be an array of tables")
            continue
        for i, item in enumerate(items):
            where = f"{section}[{i}]"
            try:
                entries.append(_key_entry(item, is_admin=is_admin, where=where))
            except ValueError as exc:
                errors.append(f"{where}: {exc}")
    for name, is_admin in ((ENV_API_KEYS, False), (ENV_ADMIN_KEYS, True)):
        text = env.get(name, "")
        if text.strip():
            try:
                entries.extend(parse_key_list(text, is_admin=is_admin, source=name))
            except ValueError as exc:
                errors.append(str(exc))
    digests = [e.digest for e in entries]
    if len(set(digests)) != len(digests):
        errors.append("the same API key is configured more than once; every key must be "
                      "distinct (an admin key is not also a tenant key)")
    return entries


def _key_entry(item: object, *, is_admin: bool, where: str) -> KeyEntry:
    if not isinstance(item, dict):
        raise ValueError("each entry is a table with a key (or key_blake2b) and a "
                         + ("name" if is_admin else "tenant"))
    owner_field = "name" if is_admin else "tenant"
    allowed = {owner_field, "key", "key_blake2b"}
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(allowed)}")
    owner = item.get(owner_field, DEFAULT_ADMIN_NAME if is_admin else None)
    if not isinstance(owner, str):
        raise ValueError(f"needs a `{owner_field}`")
    problem = tenant_id_problem(owner)
    if problem is not None:
        raise ValueError(problem)
    key, digest = item.get("key"), item.get("key_blake2b")
    if (key is None) == (digest is None):
        raise ValueError("give exactly one of `key` and `key_blake2b`")
    if key is not None:
        if not isinstance(key, str):
            raise ValueError("`key` must be a string")
        problem = key_problem(key)
        if problem is not None:
            raise ValueError(f"the key {problem}")
        return KeyEntry.of_key(key, owner, is_admin=is_admin)
    if not isinstance(digest, str):
        raise ValueError("`key_blake2b` must be a hex string")
    return KeyEntry.of_digest(digest, owner, is_admin=is_admin)


def _optional_path(value: object) -> Path | None:
    return None if value is None or value == "" else Path(str(value)).expanduser()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


# ---- what the data directory keeps across restarts ----------------------------------------


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (0700) if it is missing."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)


def deployment_secret(config: ServeConfig, env: Mapping[str, str]) -> bytes:
    """The deployment secret: from ``KVGATE_DEPLOYMENT_SECRET`` (hex), else the secret file,
    created (0600, random) on first start and reused after, so disk blocks stay valid.

    Raises:
        ConfigError: the secret is malformed or unreadable.
    """
    text = env.get(ENV_SECRET, "").strip()
    source = ENV_SECRET
    if not text:
        path = config.secret_path
        ensure_private_dir(path.parent)
        text = read_or_create_private(path, lambda: secrets.token_hex(SECRET_BYTES)).strip()
        source = str(path)
    try:
        secret = binascii.unhexlify(text)
    except (binascii.Error, ValueError) as exc:
        raise ConfigError(f"the deployment secret in {source} is not hex") from exc
    if not 16 <= len(secret) <= 64:
        raise ConfigError(f"the deployment secret in {source} must be 16 to 64 bytes "
                          f"(32 to 128 hex digits), got {len(secret)} bytes")
    return secret


def dev_api_key(config: ServeConfig) -> str:
    """The development key of tenant ``default`` (``data_dir/dev-api-key``, 0600), created on
    first start and reused after. Only for a server with no configured keys.

    Raises:
        ConfigError: the file holds something that is not a usable key.
    """
    ensure_private_dir(config.data_dir)
    key = read_or_create_private(
        config.dev_key_path, lambda: "kvg-dev-" + secrets.token_urlsafe(32)
    ).strip()
    problem = key_problem(key)
    if problem is not None:
        raise ConfigError(f"the key in {config.dev_key_path} {problem}; delete the file to "
                          "get a new one")
    return key


def dev_key_entry(key: str) -> KeyEntry:
    return KeyEntry.of_key(key, DEV_TENANT)


def read_or_create_private(path: Path, make: Any) -> str:
    """The text of ``path``; if missing, ``make()`` written there first with mode 0600.

    The new file is written beside its final name, fsynced and hard-linked into place, so a
    crash never leaves a partial file and two processes starting at once agree on one value.
    """
    try:
        return _read_private(path)
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as fh:
            fh.write(str(make()) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process created it first: use theirs
    finally:
        os.unlink(tmp)
    return _read_private(path)


def _read_private(path: Path) -> str:
    with path.open("r", encoding="ascii") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("%s is readable by other users (mode %o); run chmod 600 %s",
                           path, stat.S_IMODE(mode), path)
        return fh.read()
