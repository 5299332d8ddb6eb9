"""Reading ``kvgate serve``'s configuration: file, environment and flags into one ``ServeConfig``.

Sources, later ones winning: the defaults here, a TOML or JSON file (``--config``), the
environment (``KVGATE_API_KEYS``, ``KVGATE_ADMIN_KEYS``: keys are added to the file's), and the
command line (``--host``, ``--port``, ``--data-dir``, ``--model``, ``--device``, ``--dtype``;
``--http-host``, ``--http-port``, ``--no-http``, ``--served-model-name`` for ``[http]``). Every
problem is reported at once, before anything starts, with the file's own names::

    [server]
    host = "127.0.0.1"            # a non-loopback host needs TLS (or allow_insecure_remote)
    port = 50051
    data_dir = "data"             # kv/ (disk tier), models/, secret, dev-api-key
    model = "bundled"             # or a transformers checkpoint directory
    device = "auto"               # auto | cpu | cuda | cuda:N: the model and the device tier
    dtype = "auto"                # auto (bfloat16 on a GPU, float32 on the CPU) | float32 | ...
    tls_cert = "/etc/kvgate/tls.crt"
    tls_key = "/etc/kvgate/tls.key"

    [grpc]                        # GrpcSettings: limits, keepalive, deadlines
    body_timeout_s = 5.0

    [limits]                      # LimitSettings: per-key admission, prompt size
    max_calls_per_key = 16

    [engine]                      # EngineSettings
    max_queue = 64

    [cache]                       # gateway.cache.factory.CacheConfig; sizes as bytes or "2GiB"
    host_bytes = "4GiB"
    quotas = { tenant-a = "1GiB" }

    [metrics]                     # MetricsSettings: Prometheus endpoint, off by default
    enabled = true
    port = 9464

    [http]                        # HttpSettings: the OpenAI-compatible front, on by default
    port = 8000

    [logging]                     # LoggingSettings: access log, periodic stats line
    stats_interval_s = 10.0

    [events]                      # EventsSettings: KV events for routers, off by default
    kv_events_endpoint = "tcp://127.0.0.1:5557"

    [[api_keys]]                  # key = "..." or key_blake2b = "<hex of auth.key_digest(key)>"
    tenant = "tenant-a"
    key_blake2b = "3f1c..."

    [[admin_keys]]
    name = "ops"
    key = "..."

The values themselves live in ``gateway.config.settings``, the commented example in
``gateway.config.example``, the budget checks against this machine in ``gateway.config.fit``.
The data directory also keeps what must survive restarts: the deployment secret (``secret``,
0600; it keys every block hash and MAC, so disk blocks stay valid only with the same secret)
and, when no key is configured, a development key for tenant ``default`` (``dev-api-key``):
``gateway.config.secrets``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from gateway.config.cache_section import DEFAULT_DISK_BYTES as DEFAULT_DISK_BYTES
from gateway.config.cache_section import ENV_REDIS_URL as ENV_REDIS_URL
from gateway.config.cache_section import FILE_SUFFIX, read_cache
from gateway.config.device import device_problem
from gateway.config.dtype import dtype_problem
from gateway.config.events import EventsSettings
from gateway.config.keys import (
    DEFAULT_ADMIN_NAME,
    KeyEntry,
    admin_tenant_clashes,
    key_digest,
    key_problem,
    parse_key_list,
    tenant_id_problem,
    tenants_without_keys,
)
from gateway.config.limits import LimitSettings
from gateway.config.secrets import read_secret_file
from gateway.config.settings import (
    DEFAULT_ADMIN_HOST,
    DEFAULT_DATA_DIR,
    DEFAULT_HOST,
    DEFAULT_MODEL,
    DEFAULT_PORT,
    ConfigError,
    EngineSettings,
    GrpcSettings,
    HttpSettings,
    LoggingSettings,
    MetricsSettings,
    ServeConfig,
    is_int,
)
from gateway.core.sizes import parse_size as parse_size

logger = logging.getLogger(__name__)

ENV_API_KEYS = "KVGATE_API_KEYS"
ENV_ADMIN_KEYS = "KVGATE_ADMIN_KEYS"
ENV_METRICS_TOKEN = "KVGATE_METRICS_TOKEN"
"""The scrape token both ``/metrics`` require (``[metrics] scrape_token_file`` in a file)."""

_SERVER_KEYS = frozenset(
    {"host", "port", "data_dir", "model", "tls_cert", "tls_key", "allow_insecure_remote",
     "secret_file", "admin_host", "admin_port", "device", "dtype"}
)
_SECTIONS = frozenset({"server", "grpc", "engine", "cache", "metrics", "http", "limits",
                       "logging", "events", "api_keys", "admin_keys"})
_HTTP_OVERRIDES = {"http_host": "host", "http_port": "port", "http_enabled": "enabled",
                   "served_model_name": "served_model_name"}
"""Command-line overrides of ``[http]``: the override's name -> the key it sets."""
_REPLACED = {
    ("grpc", "max_concurrent_rpcs"): "[grpc] max_concurrent_rpcs is gone: it counted calls before "
    "their keys were checked. Use [limits] max_calls (all keys) and max_calls_per_key",
}
"""Settings that no longer exist, and what replaces them (said instead of "unknown key")."""



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
        overrides: ``[server]`` values from the command line, and ``http_host``,
            ``http_port``, ``http_enabled``, ``served_model_name`` for ``[http]`` (``None``
            values are ignored).

    Raises:
        ConfigError: every problem found, in one message. Keys never appear in it.
    """
    raw = read_config_file(path) if path is not None else {}
    where = str(path) if path is not None else "the configuration"
    errors: list[str] = []
    unknown = sorted(set(raw) - _SECTIONS)
    if unknown:
        errors.append(f"{where} has unknown sections {unknown}; known: {sorted(_SECTIONS)}")

    server = dict(_table(raw, "server", errors))
    http_table = dict(_table(raw, "http", errors))
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name in _HTTP_OVERRIDES:
            http_table[_HTTP_OVERRIDES[name]] = value
        else:
            server[name] = value
    _unknown_keys("server", server, _SERVER_KEYS, errors)

    grpc_settings = _build(GrpcSettings, "grpc", _table(raw, "grpc", errors), errors)
    limits = _build(LimitSettings, "limits", _table(raw, "limits", errors), errors)
    errors.extend(limits.problems())
    engine_table = dict(_table(raw, "engine", errors))
    for sized in ("kv_budget_bytes", "tail_cache_bytes"):
        if sized in engine_table:
            try:
                engine_table[sized] = parse_size(engine_table[sized])
            except ValueError as exc:
                errors.append(f"engine.{sized}: {exc}")
                del engine_table[sized]
    engine = _build(EngineSettings, "engine", engine_table, errors)
    metrics = _metrics_settings(_table(raw, "metrics", errors), env or {}, errors)
    logging_settings = _build(LoggingSettings, "logging", _table(raw, "logging", errors), errors)
    errors.extend(logging_settings.problems())
    events = _build(EventsSettings, "events", _table(raw, "events", errors), errors)
    errors.extend(events.problems())
    if "max_body_bytes" in http_table:
        try:
            http_table["max_body_bytes"] = parse_size(http_table["max_body_bytes"])
        except ValueError as exc:
            errors.append(f"http.max_body_bytes: {exc}")
            del http_table["max_body_bytes"]
    if "served_model_name" in http_table:
        http_table["served_model_name"] = _names(http_table["served_model_name"])
    http = _build(HttpSettings, "http", http_table, errors)
    if grpc_settings is not None:
        errors.extend(grpc_settings.problems())
    if engine is not None:
        errors.extend(engine.problems())
    errors.extend(metrics.problems())
    errors.extend(http.problems())

    data_dir = Path(str(server.get("data_dir", DEFAULT_DATA_DIR))).expanduser()
    environment = env or {}
    cache = read_cache(_table(raw, "cache", errors), data_dir=data_dir, env=environment,
                       errors=errors)
    keys = _keys(raw, environment, errors)

    host = server.get("host", DEFAULT_HOST)
    if not isinstance(host, str) or not host:
        errors.append(f"server.host must be a host name or address, got {host!r}")
    port = server.get("port", DEFAULT_PORT)
    if not is_int(port) or not 0 <= port <= 65535:
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
    if (http.enabled and is_int(port) and port and http.port == port
            and http.host == host):
        errors.append(f"http.port and server.port are both {port} on {host}: give the HTTP "
                      "front a port of its own")
    allow_insecure = server.get("allow_insecure_remote", False)
    if not isinstance(allow_insecure, bool):
        errors.append("server.allow_insecure_remote must be true or false")
    admin_host = server.get("admin_host", DEFAULT_ADMIN_HOST)
    if not isinstance(admin_host, str) or not admin_host:
        errors.append(f"server.admin_host must be a host name or address, got {admin_host!r}")
    admin_port = server.get("admin_port")
    if admin_port is not None and (not is_int(admin_port) or not 0 <= admin_port <= 65535):
        errors.append(f"server.admin_port must be 0 to 65535 (or left out: the Admin service "
                      f"on the main listener), got {admin_port!r}")
    elif admin_port is not None and admin_port == port and admin_port != 0:
        errors.append("server.admin_port must differ from server.port")
    device = server.get("device", "auto")
    problem = device_problem(device)
    if problem is not None:
        errors.append(problem)
    dtype = server.get("dtype", "auto")
    problem = dtype_problem(dtype)
    if problem is not None:
        errors.append(problem)

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
        admin_host=str(admin_host), admin_port=None if admin_port is None else int(admin_port),
        keys=tuple(keys), grpc=grpc_settings, engine=engine, cache=cache, metrics=metrics,
        http=http,
        limits=limits,
        logging=logging_settings,
        events=events,
        device=str(device),
        dtype=str(dtype),
    )


def read_config_file(path: Path) -> dict[str, Any]:
    """The sections of a ``.toml`` or ``.json`` configuration, unvalidated.

    Raises:
        ConfigError: the file cannot be read or parsed.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the configuration {path} is not UTF-8 text (byte {exc.start}): "
                          "save it as UTF-8") from exc
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except RecursionError as exc:
            raise ConfigError(_too_deep(path)) from exc
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
    except RecursionError as exc:
        raise ConfigError(_too_deep(path)) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from exc


def _too_deep(path: Path) -> str:
    # NOTE: the parsers recurse once per level of nesting; no setting of kvgate nests more
    # than a few levels, so a file that exhausts the stack is malformed, not large.
    return (f"{path} nests arrays or tables too deeply to parse; no kvgate setting nests more "
            "than a few levels: check the file for a run of '[' or '{'")


def _table(raw: Mapping[str, Any], name: str, errors: list[str]) -> Mapping[str, Any]:
    value = raw.get(name, {})
    if not isinstance(value, dict):
        errors.append(f"[{name}] must be a table")
        return {}
    return value


def _unknown_keys(section: str, table: Mapping[str, Any], known: frozenset[str],
                  errors: list[str]) -> None:
    replaced = [name for name in table if (section, name) in _REPLACED]
    errors.extend(_REPLACED[(section, name)] for name in replaced)
    unknown = sorted(set(table) - known - set(replaced))
    if unknown:
        errors.append(f"[{section}] has unknown keys {unknown}; known: {sorted(known)}")


def _names(value: object) -> object:
    """``served_model_name`` as a tuple: one id (a string) or a list of them (TOML, JSON, the
    command line); anything else is left for ``HttpSettings.problems`` to name."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _build(cls: Any, section: str, table: Mapping[str, Any], errors: list[str]) -> Any:
    known = frozenset(f.name for f in fields(cls))
    _unknown_keys(section, table, known, errors)
    return cls(**{k: v for k, v in table.items() if k in known})


def _metrics_settings(table: Mapping[str, Any], env: Mapping[str, str],
                      errors: list[str]) -> MetricsSettings:
    """``[metrics]``, with the scrape token read from ``KVGATE_METRICS_TOKEN``, else the file
    ``KVGATE_METRICS_TOKEN_FILE`` names, else ``scrape_token_file`` (a file refused if others
    may read it, as every secret file), and kept as its digest."""
    values = dict(table)
    if "scrape_token_digest" in values:
        errors.append("[metrics] scrape_token_digest is not a setting: give the token in "
                      f"scrape_token_file, {ENV_METRICS_TOKEN} or {ENV_METRICS_TOKEN}{FILE_SUFFIX}")
        del values["scrape_token_digest"]
    if values.get("scrape_token_file") is not None:
        values["scrape_token_file"] = Path(str(values["scrape_token_file"])).expanduser()
    settings: MetricsSettings = _build(MetricsSettings, "metrics", values, errors)
    token, source = env.get(ENV_METRICS_TOKEN, "").strip(), ENV_METRICS_TOKEN
    file_name = env.get(ENV_METRICS_TOKEN + FILE_SUFFIX, "")
    path = Path(file_name) if file_name else settings.scrape_token_file
    if not token and path is not None:
        source = (ENV_METRICS_TOKEN + FILE_SUFFIX if file_name
                  else "metrics.scrape_token_file")
        try:
            token = read_secret_file(path).strip()
        except ConfigError as exc:
            errors.append(f"{source}: {exc}")
            return settings
        except OSError as exc:
            errors.append(f"{source}: cannot read {path}: {exc.strerror}")
            return settings
        if not token:
            errors.append(f"{source}: {path} is empty")
            return settings
    if not token:
        return settings
    problem = key_problem(token)
    if problem is not None:
        errors.append(f"the metrics scrape token in {source} {problem}")
        return settings
    return replace(settings, scrape_token_digest=key_digest(token))


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
        file_name = env.get(name + FILE_SUFFIX, "")
        if file_name:
            try:
                text += "," + ",".join(read_secret_file(Path(file_name)).split())
            except ConfigError as exc:
                errors.append(f"{name}{FILE_SUFFIX}: {exc}")
            except OSError as exc:
                errors.append(f"{name}{FILE_SUFFIX}: cannot read {file_name}: {exc.strerror}")
        if text.strip(","):
            try:
                entries.extend(parse_key_list(text, is_admin=is_admin, source=name))
            except ValueError as exc:
                errors.append(str(exc))
    for name in admin_tenant_clashes(entries):
        errors.append(f"the admin name {name!r} is also a tenant id: name admin keys apart "
                      "from tenants (an admin's prompts would share that tenant's cache)")
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
