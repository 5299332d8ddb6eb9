"""What the data directory keeps across restarts: the deployment secret and the dev key.

The deployment secret (``secret``, 0600) keys every block hash and MAC, so disk blocks stay
valid only with the same secret; replicas sharing a Redis tier must all use the same one
(``KVGATE_DEPLOYMENT_SECRET``). When no API key is configured, ``kvgate serve`` creates a
development key for tenant ``default`` (``dev-api-key``) and one for the admin ``dev-admin``
(``dev-admin-key``), so that ``kvgate admin`` works on the same machine out of the box. The
files are created atomically and reused after, so two processes starting at once agree on one
value.
"""

from __future__ import annotations

import binascii
import logging
import os
import secrets
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gateway.config.keys import KeyEntry, key_problem
from gateway.config.settings import ConfigError, ServeConfig

logger = logging.getLogger(__name__)

DEV_TENANT = "default"
DEV_ADMIN = "dev-admin"
"""The development admin's name: not a tenant's (``admin_tenant_clashes``), and not
``DEV_TENANT``, whose cache scope an admin key would otherwise share."""
SECRET_BYTES = 32

MIN_DISTINCT_SECRET_BYTES = 8
"""16 random bytes have ~15.5 distinct values; fewer than 8 is a pattern (``00..``, ``abab..``)."""

ENV_SECRET = "KVGATE_DEPLOYMENT_SECRET"
"""Hex of the deployment secret; replicas sharing a Redis tier must all use the same one."""


def ensure_private_dir(path: Path) -> None:
    """Create ``path`` (0700) if it is missing.

    Raises:
        ConfigError: ``path`` (or a directory above it) is a file, or cannot be created.
    """
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError as exc:
        raise ConfigError(f"the data directory {path} exists but is not a directory: move the "
                          "file away or choose another ([server] data_dir, --data-dir)") from exc
    except OSError as exc:
        raise ConfigError(f"cannot create the data directory {path}: {exc.strerror}; choose "
                          "one this user can write ([server] data_dir, --data-dir)") from exc


def deployment_secret(config: ServeConfig, env: Mapping[str, str]) -> bytes:
    """The deployment secret: from ``KVGATE_DEPLOYMENT_SECRET`` (hex), else the secret file,
    created (0600, random) on first start and reused after, so disk blocks stay valid.

    Raises:
        ConfigError: the secret is malformed, has little entropy, is unreadable or is open to
            other users.
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
    if len(set(secret)) < MIN_DISTINCT_SECRET_BYTES:
        raise ConfigError(
            f"the deployment secret in {source} has too little entropy ({len(set(secret))} "
            "distinct bytes): make one with python3 -c 'import secrets; "
            "print(secrets.token_hex(32))'")
    return secret


def dev_api_key(config: ServeConfig) -> str:
    """The development key of tenant ``default`` (``data_dir/dev-api-key``, 0600), created on
    first start and reused after. Only for a server with no configured keys.

    Raises:
        ConfigError: the file holds something that is not a usable key, or is open to other
            users.
    """
    return _dev_key(config.data_dir, config.dev_key_path, "kvg-dev-")


def dev_admin_key(config: ServeConfig) -> str:
    """The development admin key (``data_dir/dev-admin-key``, 0600), made and checked as
    ``dev_api_key`` makes the tenant's. Only for a server with no configured keys.

    Raises:
        ConfigError: as ``dev_api_key``.
    """
    return _dev_key(config.data_dir, config.dev_admin_key_path, "kvg-dev-admin-")


def _dev_key(data_dir: Path, path: Path, prefix: str) -> str:
    ensure_private_dir(data_dir)
    key = read_or_create_private(path, lambda: prefix + secrets.token_urlsafe(32)).strip()
    problem = key_problem(key)
    if problem is not None:
        raise ConfigError(f"the key in {path} {problem}; delete the file to get a new one")
    return key


def dev_key_entry(key: str) -> KeyEntry:
    return KeyEntry.of_key(key, DEV_TENANT)


def dev_admin_entry(key: str) -> KeyEntry:
    return KeyEntry.of_key(key, DEV_ADMIN, is_admin=True)


def read_or_create_private(path: Path, make: Any) -> str:
    """The text of ``path``; if missing, ``make()`` written there first with mode 0600.

    The new file is written beside its final name, fsynced and hard-linked into place, so a
    crash never leaves a partial file and two processes starting at once agree on one value.
    """
    try:
        return read_secret_file(path)
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
    return read_secret_file(path)


def read_secret_file(path: Path) -> str:
    """The text of a secret file, refused if other users could read or change it.

    Others (the "other" class) may have no access at all, and the group none either, with one
    exception: read access for the process's own group, which is how Kubernetes mounts a
    Secret for a pod with an ``fsGroup`` (root-owned, the pod's group, mode 0440 whatever
    ``defaultMode`` says).

    Raises:
        ConfigError: the file's mode gives others, or a group other than ours, any access.
    """
    with path.open("r", encoding="ascii") as fh:
        info = os.fstat(fh.fileno())
        mode = info.st_mode
        group_bits = mode & stat.S_IRWXG
        is_own_group_read = group_bits == stat.S_IRGRP and info.st_gid == os.getegid()
        if mode & stat.S_IRWXO or (group_bits and not is_own_group_read):
            raise ConfigError(
                f"{path} is open to other users (mode {stat.S_IMODE(mode):o}): it holds a "
                f"secret. Run chmod 600 {path} (in Kubernetes, mount the Secret with "
                "defaultMode: 0400 and the pod's fsGroup)")
        return fh.read()
