"""``[cache]`` and its ``[[cache.tier]]`` tables, read into one ``CacheConfig``.

    [cache]
    block_tokens = 64
    quotas = { tenant-a = "1GiB" }

    [[cache.tier]]                # fastest first; the device tier always, and first
    kind = "device"
    bytes = "2GiB"

    [[cache.tier]]
    kind = "host"
    bytes = "4GiB"

    [[cache.tier]]
    kind = "disk"
    bytes = "8GiB"                # path: data_dir/kv unless given

Each table is read by its kind's record (``tiers.kinds``: its keys, sizes and ``problems()``).
The old keys (``host_bytes``, ``disk_bytes``, ``redis_url``, ...) still read, with one
deprecation line; without either, the tiers are the old defaults: device, host and a disk tier
under ``data_dir/kv``. ``KVGATE_REDIS_URL`` (or the file ``KVGATE_REDIS_URL_FILE`` names) sets
the Redis tier's URL, adding the tier where the file has none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.cache.config import CacheConfig
from gateway.cache.legacy_keys import LEGACY_KEYS, LEGACY_SIZE_KEYS, QUANTIZE_NOT_A_TABLE
from gateway.config.fit import machine_fit_problems
from gateway.config.key_section import FILE_SUFFIX
from gateway.config.keys import tenant_id_problem
from gateway.config.secrets import read_secret_file
from gateway.config.settings import ConfigError
from gateway.core.sizes import GiB, parse_size
from tiers.kinds.base import record_from_table
from tiers.kinds.registry import TIER_KINDS, kind_of, tier_list_problems

logger = logging.getLogger(__name__)

DEFAULT_DISK_BYTES = 8 * GiB
ENV_REDIS_URL = "KVGATE_REDIS_URL"
"""Overrides the Redis tier's URL, so that a Redis password need not sit in the config file."""

_OWN_KEYS = frozenset({"block_tokens", "order", "quotas", "tenant_quota", "write_queue_bytes",
                       "compression", "reprobe_interval_s", "skip_slow_tiers",
                       "measure_at_start", "sweep_interval_s", "session_ttl_s",
                       "max_sessions_per_tenant"})
"""``[cache]``'s own keys, beside ``tier`` and the old tier keys."""
_TIER = "tier"


def read_cache(table: Mapping[str, Any], *, data_dir: Path, env: Mapping[str, str],
               errors: list[str]) -> CacheConfig | None:
    """``[cache]`` as a ``CacheConfig``; every problem appended to ``errors`` (then None)."""
    num_errors = len(errors)
    unknown = sorted(set(table) - _OWN_KEYS - LEGACY_KEYS - {_TIER})
    if unknown:
        errors.append(f"[cache] has unknown keys {unknown}; known: "
                      f"{sorted(_OWN_KEYS | LEGACY_KEYS | {_TIER})}")
    values = _own_values(table, errors)
    old = {key: table[key] for key in table if key in LEGACY_KEYS}
    url = _redis_url(env, errors)
    if _TIER in table:
        if old:
            errors.append(f"[cache] gives the tiers as [[cache.tier]] and as the old keys "
                          f"{sorted(old)}: keep the [[cache.tier]] tables")
        values["tiers"] = _tier_list(table[_TIER], url, data_dir, errors)
    else:
        if old:
            logger.warning("[cache] %s: deprecated keys, read as a tier list; write the tiers "
                           "as [[cache.tier]] tables (kind, bytes, ...: docs/configuration.md)",
                           ", ".join(sorted(old)))
        values.update(_old_values(old, data_dir, errors))
        if url is not None:
            values["redis_url"] = url
    if len(errors) > num_errors:
        return None
    try:
        config = CacheConfig(**values)
    except (ValueError, TypeError) as exc:
        errors.append(f"[cache]: {exc}")
        return None
    errors.extend(machine_fit_problems(config))
    return config


def _own_values(table: Mapping[str, Any], errors: list[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in _OWN_KEYS & set(table):
        value = table[name]
        try:
            if name == "write_queue_bytes":
                value = parse_size(value)
            elif name in ("quotas", "tenant_quota"):
                what = "tenant" if name == "quotas" else "tier"
                if not isinstance(value, dict):
                    raise ValueError(f"{name} must be a table of {what} = size")
                value = {str(key): parse_size(size) for key, size in value.items()}
        except ValueError as exc:
            errors.append(f"cache.{name}: {exc}")
            continue
        values[name] = value
    for tenant in values.get("quotas", {}):
        problem = tenant_id_problem(tenant)
        if problem is not None:
            errors.append(f"cache.quotas: {problem}")
    return values


def _old_values(old: Mapping[str, Any], data_dir: Path, errors: list[str]) -> dict[str, Any]:
    """The old keys' values, sizes and paths parsed; the disk tier's old defaults (8 GiB under
    ``data_dir/kv``) where they are left out."""
    values: dict[str, Any] = {"disk_bytes": DEFAULT_DISK_BYTES, "disk_path": data_dir / "kv"}
    for name, value in old.items():
        try:
            if name in LEGACY_SIZE_KEYS:
                value = parse_size(value)
            elif name == "disk_path":
                value = Path(str(value)).expanduser()
            elif name == "quantize" and not isinstance(value, dict):
                raise ValueError(QUANTIZE_NOT_A_TABLE)
        except ValueError as exc:
            errors.append(f"cache.{name}: {exc}")
            continue
        values[name] = value
    return values


def _tier_list(tables: object, url: str | None, data_dir: Path,
               errors: list[str]) -> tuple[Any, ...]:
    """The ``[[cache.tier]]`` tables as records (the URL from the environment set on, or
    added as, the Redis tier)."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        errors.append("[[cache.tier]] must be an array of tables, each with a kind")
        return ()
    tables = [dict(t) for t in tables]
    if url is not None:
        remote = [t for t in tables if t.get("kind") in TIER_KINDS
                  and TIER_KINDS[t["kind"]].is_remote]
        if remote:
            remote[0]["url"] = url
        else:
            tables.append({"kind": "redis", "url": url})
    records = []
    for i, entry in enumerate(tables):
        where = f"cache.tier[{i}]"
        try:
            kind = kind_of(entry.get("kind"))
        except ValueError as exc:
            errors.append(f"{where}: {exc}")
            continue
        record, problems = record_from_table(kind.config_type, entry, where, data_dir=data_dir)
        errors.extend(problems)
        records.append(record)
    if len(records) == len(tables):  # the list as a whole, beside its tables' own problems
        errors.extend(f"[[cache.tier]]: {problem}"
                      for problem in tier_list_problems([t["kind"] for t in tables]))
    return tuple(records)


def _redis_url(env: Mapping[str, str], errors: list[str]) -> str | None:
    """The Redis URL the environment gives, or None."""
    if env.get(ENV_REDIS_URL):
        return env[ENV_REDIS_URL]
    file_name = env.get(ENV_REDIS_URL + FILE_SUFFIX)
    if not file_name:
        return None
    try:
        return read_secret_file(Path(file_name)).strip()
    except ConfigError as exc:
        errors.append(f"{ENV_REDIS_URL}{FILE_SUFFIX}: {exc}")
    except OSError as exc:
        errors.append(f"{ENV_REDIS_URL}{FILE_SUFFIX}: cannot read {file_name}: {exc.strerror}")
    return None
