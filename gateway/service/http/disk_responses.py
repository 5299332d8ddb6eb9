"""Stored responses on this replica's disk, for a gateway with a disk tier and no Redis: a
conversation continued through ``previous_response_id`` survives a restart, as its cached
blocks do.

The same contract as ``MemoryResponses`` and ``RedisResponses``. On disk, one directory per
tenant (a keyed digest of its name, never the name) holding one file per response,
``{id}.{chars}.json``: a MAC (32 bytes) then the response as JSON. The file's modification time
is its last use (a read touches it): a response expires ``ttl_s`` after it, and past a tenant's
bounds its least recently used files go first. The MAC is the one ``RedisResponses`` uses
(keyed from the deployment secret): a file written or altered without the secret, or moved to
another tenant or id, reads as missing and is removed, with a warning.

An id reaches the filesystem only once it has the shape kvgate gives ids (``resp_`` and 24 hex
digits): anything else is a 404 before a path is made of it.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from gateway.service.http.response_seal import ResponseSeal
from gateway.service.http.stored_responses import StoredResponse, chars_of_conversation

logger = logging.getLogger(__name__)

_ID = re.compile(r"resp_[0-9a-f]{24}")
_FILE = re.compile(r"(resp_[0-9a-f]{24})\.(\d+)\.json")


class DiskResponses:
    """Stored responses under ``root``, per tenant, least recently used dropped first.

    Args:
        root: the directory (created 0700).
        mac_key: ``response_seal.responses_mac_key(deployment_secret)``.
        max_per_tenant, max_chars_per_tenant, default_ttl_s: as ``MemoryResponses``'.
        clock: wall-clock seconds (file times are).
    """

    def __init__(self, root: Path, *, mac_key: bytes, max_per_tenant: int,
                 max_chars_per_tenant: int, default_ttl_s: float | None,
                 clock: Callable[[], float] = time.time) -> None:
        if max_per_tenant < 1 or max_chars_per_tenant < 1:
            raise ValueError(f"max_per_tenant and max_chars_per_tenant must be >= 1, got "
                             f"{max_per_tenant} and {max_chars_per_tenant}")
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._root = root
        self._seal = ResponseSeal(mac_key)
        self._max = max_per_tenant
        self._max_chars = max_chars_per_tenant
        self._default_ttl_s = default_ttl_s
        self._clock = clock
        self._lock = threading.Lock()

    def put(self, *, id: str, tenant: str, messages: Sequence[Mapping[str, str]],
            body: Mapping[str, object], ttl_s: float | None = None) -> None:
        """Keep a response (``ttl_s`` None: the store's default); logged if the disk fails."""
        if not _ID.fullmatch(id):
            raise ValueError(f"not a response id kvgate makes: {id!r}")
        ttl = self._default_ttl_s if ttl_s is None else ttl_s
        tag = self._seal.tag(tenant)
        folder = self._root / tag
        with self._lock:
            try:
                folder.mkdir(mode=0o700, exist_ok=True)
                for old in self._files_of(folder, id):
                    old.unlink(missing_ok=True)
                target = folder / f"{id}.{chars_of_conversation(messages)}.json"
                fd, partial = tempfile.mkstemp(dir=folder, prefix=".", suffix=".part")
                with os.fdopen(fd, "wb") as fh:
                    fh.write(self._seal.sealed(tag, id, messages, body, ttl))
                os.replace(partial, target)
                self._trim(folder, keep=target)
            except OSError as exc:
                logger.warning("a response (%s) could not be kept on disk, so it cannot be "
                               "continued or read: %s", id, exc)

    def get(self, tenant: str, id: str) -> StoredResponse | None:
        """``tenant``'s response ``id``, its last use now; None if it has none such (another
        tenant's id, an expired one and one that fails its MAC included)."""
        if not _ID.fullmatch(id):
            return None
        tag = self._seal.tag(tenant)
        with self._lock:
            found = self._files_of(self._root / tag, id)
            if not found:
                return None
            path = found[0]
            try:
                value = path.read_bytes()
                used = path.stat().st_mtime
            except OSError:
                return None
            fields = self._seal.opened(tag, id, value, "the disk")
            if fields is None:
                path.unlink(missing_ok=True)
                return None
            ttl = None if fields.get("ttl_s") is None else float(fields["ttl_s"])
            now = self._clock()
            if ttl is not None and used + ttl <= now:
                path.unlink(missing_ok=True)
                return None
            os.utime(path, (now, now))
        return StoredResponse(id=id, tenant=tenant,
                              messages=tuple(dict(m) for m in fields["messages"]),
                              body=fields["body"], ttl_s=ttl)

    def delete(self, tenant: str, id: str) -> bool:
        """Drop ``tenant``'s response ``id``; whether it had one (an expired one counts as
        gone)."""
        alive = self.get(tenant, id) is not None
        if _ID.fullmatch(id):
            with self._lock:
                for path in self._files_of(self._root / self._seal.tag(tenant), id):
                    path.unlink(missing_ok=True)
        return alive

    def chars_of(self, tenant: str) -> int:
        """The characters of conversation ``tenant`` keeps now."""
        with self._lock:
            return sum(chars for _, chars, _ in self._listing(self._root / self._seal.tag(tenant)))

    # ---- files ------------------------------------------------------------------------

    def _trim(self, folder: Path, *, keep: Path) -> None:
        """Drop the tenant's least recently used files while it is over either bound (never
        ``keep``, the one just written)."""
        files = sorted(self._listing(folder))  # oldest first
        total = sum(chars for _, chars, _ in files)
        while len(files) > 1 and (len(files) > self._max or total > self._max_chars):
            victim = next(f for f in files if f[2] != keep)
            victim[2].unlink(missing_ok=True)
            files.remove(victim)
            total -= victim[1]

    @staticmethod
    def _listing(folder: Path) -> list[tuple[float, int, Path]]:
        """(last use, characters, path) of each response file in ``folder``."""
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            match = _FILE.fullmatch(entry.name)
            if match:
                try:
                    found.append((entry.stat().st_mtime, int(match.group(2)), Path(entry.path)))
                except FileNotFoundError:
                    continue
        return found

    @staticmethod
    def _files_of(folder: Path, id: str) -> list[Path]:
        return sorted(folder.glob(f"{id}.*.json")) if folder.is_dir() else []
