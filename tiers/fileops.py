"""The one seam through which the disk tier touches the filesystem.

``DiskStore`` never calls ``os`` directly: every syscall that matters for durability (create,
write, fsync, rename, directory fsync, unlink) goes through a ``FileOps``. Production uses
``RealFileOps``, a thin layer over ``os``; tests substitute a double that injects an errno on
the Nth call of an operation, freezes an operation mid-flight, or simulates a power loss
(``tests/tiers/faulty_fs.py``). Keeping the seam this small is what makes those faults cheap
to reproduce.

Every operation reports failure as ``OSError`` carrying an ``errno``; nothing here retries,
logs or interprets errors: the store decides what an errno means (disk full → stop writing,
EIO → drop the block).

Paths are ``str`` (the store builds them once; ``os`` functions take them without conversion).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Protocol

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

TEMP_SUFFIX = ".tmp"
"""Suffix of every temp file: recovery deletes files with it and never reads them."""

_MAX_READ_CHUNK = 1 << 30
"""Linux returns at most ~2 GiB from one read(2); stay well below it."""


class FileOps(Protocol):
    """Filesystem operations of the disk tier. Each raises ``OSError`` (with ``errno``)."""

    def mkdir(self, path: str, mode: int) -> None:
        """Create one directory level; ``FileExistsError`` if it exists."""
        ...

    def open_temp(self, directory: str, prefix: str) -> tuple[int, str]:
        """Create a new, empty, uniquely named ``<prefix>.<random>.tmp`` file in ``directory``.

        Opened ``O_CREAT | O_EXCL | O_WRONLY`` with mode 0600. Returns (fd, path).
        """
        ...

    def write(self, fd: int, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` (looping over short writes)."""
        ...

    def fsync(self, fd: int) -> None: ...

    def close(self, fd: int) -> None: ...

    def replace(self, src: str, dst: str) -> None:
        """Atomically rename ``src`` over ``dst`` (same directory)."""
        ...

    def fsync_dir(self, path: str) -> None:
        """Make the directory's entries (creations, renames) durable."""
        ...

    def unlink(self, path: str) -> None: ...

    def read(self, path: str, max_bytes: int | None) -> bytes:
        """The file's first ``max_bytes`` bytes (all of it when None).

        Refuses symlinks (ELOOP) and anything but a regular file (EINVAL), without blocking on
        a FIFO.
        """
        ...

    def size(self, path: str) -> int: ...

    def scandir(self, path: str) -> list[tuple[str, bool]]:
        """(name, is_dir) for each entry, symlinks reported as files, in no particular order."""
        ...


class RealFileOps:
    """``FileOps`` over the ``os`` module."""

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(path, mode)

    def open_temp(self, directory: str, prefix: str) -> tuple[int, str]:
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | _O_NOFOLLOW | _O_CLOEXEC
        for _ in range(16):
            path = os.path.join(directory, f"{prefix}.{secrets.token_hex(6)}{TEMP_SUFFIX}")
            try:
                return os.open(path, flags, 0o600), path
            except FileExistsError:
                continue
        raise FileExistsError(errno.EEXIST, "no unique temp name after 16 tries", directory)

    def write(self, fd: int, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            written = os.write(fd, view)
            if written <= 0:  # pragma: no cover - write(2) reports errors as OSError
                raise OSError(errno.EIO, "write returned 0")
            view = view[written:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def read(self, path: str, max_bytes: int | None) -> bytes:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            want = info.st_size
            if max_bytes is not None:
                want = min(want, max_bytes)
            first = os.read(fd, min(want, _MAX_READ_CHUNK))
            if len(first) >= want or not first:
                return first
            chunks = [first]
            got = len(first)
            while got < want:
                chunk = os.read(fd, min(want - got, _MAX_READ_CHUNK))
                if not chunk:  # the file shrank under us: return what is there
                    break
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def size(self, path: str) -> int:
        return os.stat(path, follow_symlinks=False).st_size

    def scandir(self, path: str) -> list[tuple[str, bool]]:
        with os.scandir(path) as entries:
            return [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]


def write_temp(ops: FileOps, directory: str, name: str, data: bytes | bytearray | memoryview,
               *, fsync: bool) -> str:
    """Write ``data`` to a new temp file beside ``name`` in ``directory`` (synced when
    ``fsync``), ready to be renamed over its final path; returns the temp's path.

    Why one helper: every durable file here (a block, the pin manifest) is written the same
    way, temp then rename, and a temp left by a failed write is removed here, so a caller's
    clean-up only ever concerns a temp it was handed. Raises the first ``OSError``.
    """
    fd, temp = ops.open_temp(directory, name)
    try:
        try:
            ops.write(fd, data)
            if fsync:
                ops.fsync(fd)
        finally:
            ops.close(fd)
    except OSError:
        try:
            ops.unlink(temp)
        except OSError:
            pass  # recovery deletes every temp it meets
        raise
    return temp
