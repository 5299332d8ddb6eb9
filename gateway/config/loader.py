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

    [cache]                       # gateway.cache.config.CacheConfig; sizes as bytes or "2GiB"
    quotas = { tenant-a = "1GiB" }

    [[cache.tier]]                # the tiers, fastest first: device, then any kinds of
    kind = "device"               # tiers.kinds.registry.TIER_KINDS (gateway.config.cache_section)
    bytes = "2GiB"

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

Each section is read into its own record by ``gateway.config.sections`` (``[server]``:
``gateway.config.server``; ``[cache]``: ``gateway.config.cache_section``; the keys:
``gateway.config.key_section``); ``load_serve_config`` is the loop over them and the one check
that spans two. The values themselves live in ``gateway.config.settings``, the commented example
in ``gateway.config.example``, the budget checks against this machine in
``gateway.config.fit``.
The data directory also keeps what must survive restarts: the deployment secret (``secret``,
0600; it keys every block hash and MAC, so disk blocks stay valid only with the same secret)
and, when no key is configured, a development key for tenant ``default`` (``dev-api-key``):
``gateway.config.secrets``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.config.cache_section import DEFAULT_DISK_BYTES as DEFAULT_DISK_BYTES
from gateway.config.cache_section import ENV_REDIS_URL as ENV_REDIS_URL
from gateway.config.key_section import ENV_ADMIN_KEYS as ENV_ADMIN_KEYS
from gateway.config.key_section import ENV_API_KEYS as ENV_API_KEYS
from gateway.config.keys import tenants_without_keys
from gateway.config.sections import ENV_METRICS_TOKEN as ENV_METRICS_TOKEN
from gateway.config.sections import SECTIONS, TABLES, Sources, data_dir_of
from gateway.config.settings import ConfigError, HttpSettings, ServeConfig
from gateway.core.sizes import parse_size as parse_size

logger = logging.getLogger(__name__)

HTTP_OVERRIDES = {"http_host": "host", "http_port": "port", "http_enabled": "enabled",
                  "served_model_name": "served_model_name"}
"""Command-line overrides of ``[http]``: the override's name -> the key it sets; every other
override is a key of ``[server]``."""


def load_serve_config(
    path: Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> ServeConfig:
    """Read, merge and validate the configuration: each section read into its record
    (``gateway.config.sections``), then the one check that spans sections.

    Args:
        path: a ``.toml`` or ``.json`` file, or None for the defaults.
        env: the environment (``os.environ``); only ``KVGATE_*`` keys are read.
        overrides: ``[server]`` values from the command line, and ``http_host``,
            ``http_port``, ``http_enabled``, ``served_model_name`` for ``[http]`` (``None``
            values are ignored).

    Raises:
        ConfigError: every problem found, in one message. Keys never appear in it.
    """
    raw = with_overrides(read_config_file(path) if path is not None else {}, overrides or {})
    errors: list[str] = []
    unknown = sorted(set(raw) - TABLES)
    if unknown:
        where = str(path) if path is not None else "the configuration"
        errors.append(f"{where} has unknown sections {unknown}; known: {sorted(TABLES)}")
    sources = Sources(env=env or {}, data_dir=data_dir_of(raw))
    records = {section.name: section.read(raw, sources, errors) for section in SECTIONS}
    errors.extend(port_clashes(records["server"].port, records["server"].host, records["http"]))
    if errors:
        raise ConfigError("invalid kvgate configuration:\n  - " + "\n  - ".join(errors))
    strays = tenants_without_keys(list(records["keys"]), records["cache"].quotas)
    if records["keys"] and strays:
        logger.warning("quotas are set for tenants that no key authenticates (typos?): %s",
                       ", ".join(strays))
    server = records.pop("server")
    return ServeConfig(**server.values(), **records)


def with_overrides(raw: Mapping[str, Any], overrides: Mapping[str, object]) -> dict[str, Any]:
    """The file's tables with the command line's values set in ``[server]`` and ``[http]``."""
    merged = dict(raw)
    for name, value in overrides.items():
        if value is None:
            continue
        section, key = ("http", HTTP_OVERRIDES[name]) if name in HTTP_OVERRIDES else (
            "server", name)
        table = merged.get(section, {})
        merged[section] = {**table, key: value} if isinstance(table, dict) else table
    return merged


def port_clashes(port: object, host: object, http: HttpSettings) -> list[str]:
    """The check across sections: the HTTP front and gRPC on one port of one host."""
    if http.enabled and isinstance(port, int) and port and http.port == port \
            and http.host == host:
        return [f"http.port and server.port are both {port} on {host}: give the HTTP front a "
                "port of its own"]
    return []


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
