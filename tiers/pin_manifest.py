"""The pin manifest: which blocks an operator pinned, kept beside the disk tier's blocks so that
pins outlive a restart (issue 44: "0 pinned blocks lost from the disk tier across kill -9 and
restarts").

Why a file of its own rather than a flag in each block's header: a block is usually written
before anyone pins it (a prefix is served, then an operator pins it), and its header is covered
by the block tag over header *and* payload, so flipping a flag would mean re-reading, re-tagging
and rewriting every byte of every block the pin names -- and a pin without a TTL has no way to
say so in format 3's expiry fields at all. One small file of keys is one atomic write per pin or
unpin, whatever the blocks weigh.

Format 1 (integers little-endian)::

    0   4s   MAGIC b"KVGP"
    4   u16  format version (FORMAT_VERSION)
    6   u32  number of keys
    10       each key: u8 length (1..MAX_KEY_LEN), then its bytes
    end 32s  keyed BLAKE3 of everything before it (a subkey of the deployment's MAC key)

Trust: the file sits on a disk an attacker may write. The tag means only a holder of the
deployment secret can name the blocks to pin; a file that does not verify (forged, truncated,
another deployment's, an old format, a symlink, too large) is ignored with a warning and the
restart starts with no pins -- never an error, never a crash. The worst a writer can do without
the secret is delete the file (the pins are lost, the blocks stay) or put back an older
manifest of the same deployment (blocks pinned once are pinned again); neither changes what is
served, which every block's own MAC decides.

Writes are atomic: a temp file in the same directory (``tiers.fileops``: its ``.tmp`` suffix is
what the disk tier's restart scan removes), written, fsynced, renamed over the manifest, and the
directory fsynced; a kill -9 at any point leaves the old manifest or the new one, whole.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import struct
from collections.abc import Collection
from pathlib import Path

from blake3 import blake3

from policies.base import BlockKey
from tiers.block_format import MAX_KEY_LEN
from tiers.block_mac import MAC_LEN
from tiers.fileops import FileOps, RealFileOps, write_temp

logger = logging.getLogger(__name__)

MAGIC = b"KVGP"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 16 << 20
"""The largest manifest read (about 500k pinned 16-byte keys); a larger file is refused unread."""

_HEAD = struct.Struct("<4sHI")
_CONTEXT = "kvgate 2026-11 pin manifest tag, format 1"
# A BLAKE3 derive_key context of its own: a manifest's tag can never stand in for a block's.


class PinManifest:
    """The set of pinned block keys in one authenticated file (see the module docstring).

    Args:
        path: the manifest file (beside the disk tier's blocks).
        mac_key: the deployment's MAC key (``tiers.block_mac.derive_mac_key``).
        fileops: the filesystem seam (``RealFileOps`` by default).
        fsync: fsync the file and its directory before a save counts (off only for throwaway
            caches, as for the disk tier's blocks).
    """

    def __init__(self, path: Path | str, mac_key: bytes, *, fileops: FileOps | None = None,
                 fsync: bool = True) -> None:
        self._path = os.path.abspath(os.fspath(path))
        self._key = blake3(mac_key, derive_key_context=_CONTEXT).digest()
        self._ops: FileOps = fileops if fileops is not None else RealFileOps()
        self._is_fsync = fsync

    @property
    def path(self) -> Path:
        return Path(self._path)

    def load(self) -> frozenset[BlockKey]:
        """The keys the manifest names; none when there is no manifest or it does not verify
        (logged: the pins are lost, nothing else is)."""
        try:
            data = self._ops.read(self._path, MAX_MANIFEST_BYTES + 1)
        except FileNotFoundError:
            return frozenset()
        except OSError as exc:
            logger.warning("pin manifest %s cannot be read (%s): no pins are restored",
                           self._path, exc.strerror or errno.errorcode.get(exc.errno or 0))
            return frozenset()
        try:
            return self._parse(data)
        except ValueError as exc:
            logger.warning("pin manifest %s is ignored (%s): no pins are restored",
                           self._path, exc)
            return frozenset()

    def save(self, keys: Collection[BlockKey]) -> bool:
        """Replace the manifest with ``keys``, atomically and durably.

        Returns:
            False when the disk refused (logged): the pins hold in this process but a restart
            would find the previous manifest.
        """
        data = self._pack(keys)
        directory = os.path.dirname(self._path)
        temp: str | None = None
        try:
            temp = write_temp(self._ops, directory, os.path.basename(self._path), data,
                              fsync=self._is_fsync)
            self._ops.replace(temp, self._path)
            temp = None
            if self._is_fsync:
                self._ops.fsync_dir(directory)
        except OSError as exc:
            if temp is not None:
                self._unlink_quietly(temp)
            logger.warning("pin manifest %s not saved (%s): %d pins hold until a restart",
                           self._path, exc.strerror or errno.errorcode.get(exc.errno or 0),
                           len(keys))
            return False
        return True

    def _pack(self, keys: Collection[BlockKey]) -> bytes:
        parts = [_HEAD.pack(MAGIC, FORMAT_VERSION, len(keys))]
        for key in sorted(keys):
            if not 1 <= len(key) <= MAX_KEY_LEN:
                raise ValueError(f"a block key of {len(key)} bytes cannot be pinned")
            parts += [bytes((len(key),)), key]
        body = b"".join(parts)
        return body + blake3(body, key=self._key).digest()

    def _parse(self, data: bytes) -> frozenset[BlockKey]:
        """The keys of an authenticated manifest. Raises ValueError saying what is wrong."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError(f"more than {MAX_MANIFEST_BYTES} bytes")
        if len(data) < _HEAD.size + MAC_LEN:
            raise ValueError(f"truncated ({len(data)} bytes)")
        magic, version, count = _HEAD.unpack_from(data)
        if magic != MAGIC:
            raise ValueError(f"not a pin manifest (magic {bytes(magic)!r})")
        if version != FORMAT_VERSION:
            raise ValueError(f"format {version}, this build reads {FORMAT_VERSION}")
        body, tag = data[:-MAC_LEN], data[-MAC_LEN:]
        if not hmac.compare_digest(blake3(body, key=self._key).digest(), tag):
            raise ValueError("its tag does not verify (another deployment's, or altered)")
        keys: set[BlockKey] = set()
        at = _HEAD.size
        for _ in range(count):
            size = body[at] if at < len(body) else 0
            if not 1 <= size <= MAX_KEY_LEN or at + 1 + size > len(body):
                raise ValueError("its keys do not fit its length")
            keys.add(BlockKey(body[at + 1: at + 1 + size]))
            at += 1 + size
        if at != len(body):
            raise ValueError("bytes after its last key")
        return frozenset(keys)

    def _unlink_quietly(self, path: str) -> None:
        try:
            self._ops.unlink(path)
        except OSError as exc:
            logger.debug("pin manifest: cannot remove %s: %s", path, exc.strerror)
