"""``[[api_keys]]`` and ``[[admin_keys]]``, with the keys the environment adds
(``KVGATE_API_KEYS``, ``KVGATE_ADMIN_KEYS``, or the files their ``_FILE`` twins name), read into
``KeyEntry`` records (``gateway.config.keys``): one list, every problem listed without a key in
it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.config.keys import (
    DEFAULT_ADMIN_NAME,
    KeyEntry,
    admin_tenant_clashes,
    key_problem,
    parse_key_list,
    tenant_id_problem,
)
from gateway.config.secrets import read_secret_file
from gateway.config.settings import ConfigError

ENV_API_KEYS = "KVGATE_API_KEYS"
ENV_ADMIN_KEYS = "KVGATE_ADMIN_KEYS"
FILE_SUFFIX = "_FILE"
"""``KVGATE_API_KEYS_FILE`` / ``KVGATE_ADMIN_KEYS_FILE`` / ``KVGATE_REDIS_URL_FILE``: the same
values read from a file (a mounted Secret; refused if other users may read it); key lists one
entry per line or comma-separated."""


def read_keys(raw: Mapping[str, Any], env: Mapping[str, str],
              errors: list[str]) -> list[KeyEntry]:
    """Every key of ``[[api_keys]]``, ``[[admin_keys]]`` and the environment; each problem
    appended to ``errors`` (a key itself never appears in one)."""
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
