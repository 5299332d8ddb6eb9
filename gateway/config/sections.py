"""The sections of ``kvgate serve``'s configuration, each read into its own record.

``SECTIONS`` lists them in the order they are read; each ``Section`` knows its table's name and
how to read it: a plain record (``plain``: its keys checked against its fields, its sizes
parsed, then its ``problems()``), or a reader of its own where a section takes more than its
table (``[metrics]`` and ``[cache]`` read the environment; the keys come from two tables and
the environment). ``gateway.config.loader.load_serve_config`` is the loop over them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from gateway.config.cache_section import read_cache
from gateway.config.events import EventsSettings
from gateway.config.key_section import FILE_SUFFIX, read_keys
from gateway.config.keys import key_digest, key_problem
from gateway.config.limits import LimitSettings
from gateway.config.secrets import read_secret_file
from gateway.config.server import ServerSettings
from gateway.config.settings import (
    DEFAULT_DATA_DIR,
    ConfigError,
    EngineSettings,
    GrpcSettings,
    HttpSettings,
    LoggingSettings,
    MetricsSettings,
)
from gateway.core.sizes import parse_size

ENV_METRICS_TOKEN = "KVGATE_METRICS_TOKEN"
"""The scrape token both ``/metrics`` require (``[metrics] scrape_token_file`` in a file)."""
REPLACED = {
    ("grpc", "max_concurrent_rpcs"): "[grpc] max_concurrent_rpcs is gone: it counted calls before "
    "their keys were checked. Use [limits] max_calls (all keys) and max_calls_per_key",
}
"""Settings that no longer exist, and what replaces them (said instead of "unknown key")."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sources:
    """What a section may read besides its table: the environment, and the data directory
    ``[server]`` names (where the disk tier keeps its files unless ``[cache]`` says)."""

    env: Mapping[str, str]
    data_dir: Path


Reader = Callable[[Mapping[str, Any], Sources, list[str]], Any]
"""(the whole file, its sources, the problems so far) -> the section's record."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Section:
    """One section: the name it has in ``ServeConfig`` and how it is read."""

    name: str
    read: Reader
    tables: tuple[str, ...] = ()
    """The file's tables it reads (its name, unless it says otherwise)."""


def table(raw: Mapping[str, Any], name: str, errors: list[str]) -> Mapping[str, Any]:
    """The table ``name`` of the file (empty where it is left out)."""
    value = raw.get(name, {})
    if not isinstance(value, dict):
        errors.append(f"[{name}] must be a table")
        return {}
    return value


def unknown_keys(section: str, values: Mapping[str, Any], known: frozenset[str],
                 errors: list[str]) -> None:
    """Name the keys of ``values`` that ``section`` does not have (and what replaced a key
    that is gone)."""
    replaced = [name for name in values if (section, name) in REPLACED]
    errors.extend(REPLACED[(section, name)] for name in replaced)
    unknown = sorted(set(values) - known - set(replaced))
    if unknown:
        errors.append(f"[{section}] has unknown keys {unknown}; known: {sorted(known)}")


def build(cls: Any, section: str, values: Mapping[str, Any], errors: list[str]) -> Any:
    """``cls`` of the known keys of ``values``; the others named in ``errors``."""
    known = frozenset(f.name for f in fields(cls))
    unknown_keys(section, values, known, errors)
    return cls(**{k: v for k, v in values.items() if k in known})


def parse_sizes(section: str, values: dict[str, Any], names: tuple[str, ...],
                errors: list[str]) -> None:
    """Sizes (``"512MiB"``) of ``names`` parsed in place; one that is not a size is named and
    left out."""
    for name in names:
        if name in values:
            try:
                values[name] = parse_size(values[name])
            except ValueError as exc:
                errors.append(f"{section}.{name}: {exc}")
                del values[name]


def plain(cls: Any, name: str, *, sizes: tuple[str, ...] = (),
          adjust: Callable[[dict[str, Any]], None] | None = None) -> Section:
    """A section that is its record: keys checked against its fields, sizes parsed, the record
    built, then its ``problems()``."""

    def read(raw: Mapping[str, Any], sources: Sources, errors: list[str]) -> Any:
        values = dict(table(raw, name, errors))
        parse_sizes(name, values, sizes, errors)
        if adjust is not None:
            adjust(values)
        record = build(cls, name, values, errors)
        errors.extend(record.problems())
        return record

    return Section(name=name, read=read)


def data_dir_of(raw: Mapping[str, Any]) -> Path:
    """The data directory ``[server]`` names (the default where it names none)."""
    server = raw.get("server")
    value = server.get("data_dir") if isinstance(server, dict) else None
    return Path(str(value if value is not None else DEFAULT_DATA_DIR)).expanduser()


def _read_server(raw: Mapping[str, Any], sources: Sources, errors: list[str]) -> ServerSettings:
    values = dict(table(raw, "server", errors))
    unknown_keys("server", values, frozenset(f.name for f in fields(ServerSettings)), errors)
    known = {f.name for f in fields(ServerSettings)}
    server = ServerSettings.of_table({k: v for k, v in values.items() if k in known})
    errors.extend(server.problems())
    return server


def _served_model_names(values: dict[str, Any]) -> None:
    """``served_model_name`` as a tuple: one id (a string) or a list of them (TOML, JSON, the
    command line); anything else is left for ``HttpSettings.problems`` to name."""
    names = values.get("served_model_name")
    if isinstance(names, str):
        values["served_model_name"] = (names,)
    elif isinstance(names, (list, tuple)):
        values["served_model_name"] = tuple(names)


def _read_metrics(raw: Mapping[str, Any], sources: Sources,
                  errors: list[str]) -> MetricsSettings:
    """``[metrics]``, with the scrape token read from ``KVGATE_METRICS_TOKEN``, else the file
    ``KVGATE_METRICS_TOKEN_FILE`` names, else ``scrape_token_file`` (a file refused if others
    may read it, as every secret file), and kept as its digest."""
    values = dict(table(raw, "metrics", errors))
    env = sources.env
    if "scrape_token_digest" in values:
        errors.append("[metrics] scrape_token_digest is not a setting: give the token in "
                      f"scrape_token_file, {ENV_METRICS_TOKEN} or {ENV_METRICS_TOKEN}{FILE_SUFFIX}")
        del values["scrape_token_digest"]
    if values.get("scrape_token_file") is not None:
        values["scrape_token_file"] = Path(str(values["scrape_token_file"])).expanduser()
    settings: MetricsSettings = build(MetricsSettings, "metrics", values, errors)
    errors.extend(settings.problems())
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


def _read_cache(raw: Mapping[str, Any], sources: Sources, errors: list[str]) -> Any:
    return read_cache(table(raw, "cache", errors), data_dir=sources.data_dir, env=sources.env,
                      errors=errors)


def _read_keys(raw: Mapping[str, Any], sources: Sources, errors: list[str]) -> Any:
    return tuple(read_keys(raw, sources.env, errors))


SECTIONS: tuple[Section, ...] = (
    Section(name="server", read=_read_server),
    plain(GrpcSettings, "grpc"),
    plain(LimitSettings, "limits"),
    plain(EngineSettings, "engine", sizes=("kv_budget_bytes", "tail_cache_bytes")),
    Section(name="metrics", read=_read_metrics),
    plain(LoggingSettings, "logging"),
    plain(EventsSettings, "events"),
    plain(HttpSettings, "http", sizes=("max_body_bytes",), adjust=_served_model_names),
    Section(name="cache", read=_read_cache),
    Section(name="keys", read=_read_keys, tables=("api_keys", "admin_keys")),
)
"""Every section, in the order it is read (its problems listed in that order)."""
TABLES = frozenset(name for section in SECTIONS for name in (section.tables or (section.name,)))
"""The tables a file may have."""
