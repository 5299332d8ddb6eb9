"""Where the disk tier keeps each block's file, and how its directories are made durable.

Layout: ``root/ab/cd/<keyhex>.kvb``, where ``abcd`` are the first four hex digits of the key
(right-padded with ``0`` for keys shorter than two bytes): two levels of 256 shards keep every
directory small. Directories are 0700: stored KV can be inverted back into the prompt.

Apart from ``DiskStore`` because both the writer and the restart scan (``tiers.disk_recovery``)
need the same answer to "which file is this key's", and because a new directory only counts
once its parent is fsynced -- a rule that belongs with the directories, not with the queue.
"""

from __future__ import annotations

import os

from policies.base import BlockKey
from tiers.fileops import FileOps

FILE_SUFFIX = ".kvb"
DIR_MODE = 0o700

_HEX_DIGITS = frozenset("0123456789abcdef")


class ShardLayout:
    """The shard directories under one root, through the ``FileOps`` seam.

    Not thread-safe: ``DiskStore`` changes it from ``start`` (before its writer thread runs)
    and then from the writer thread alone; ``path_for`` (no state) is called from any thread.

    Args:
        root: the store's directory (absolute).
        ops: the filesystem seam.
        fsync: fsync the parent of every directory created, so that its entry survives a
            power loss.
    """

    def __init__(self, root: str, ops: FileOps, *, fsync: bool) -> None:
        self.root = root
        self._ops = ops
        self._is_fsync = fsync
        self._known_dirs: set[str] = set()

    def path_for(self, key: BlockKey) -> str:
        """The file of ``key``."""
        hexkey = key.hex()
        padded = hexkey.ljust(4, "0")
        return os.path.join(self.root, padded[:2], padded[2:4], hexkey + FILE_SUFFIX)

    def mark_root_known(self) -> None:
        """``start`` created (or found) the root: writers need not create it again."""
        self._known_dirs.add(self.root)

    def forget_known_dirs(self) -> None:
        """A directory vanished under a write: create every directory again on next use."""
        self._known_dirs.clear()

    def make_dirs(self, path: str) -> None:
        """``mkdir -p`` through the seam, fsyncing the parent of each directory it creates."""
        try:
            self._ops.mkdir(path, DIR_MODE)
        except FileExistsError:
            return
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                raise
            self.make_dirs(parent)
            try:
                self._ops.mkdir(path, DIR_MODE)
            except FileExistsError:
                return
        if self._is_fsync:
            self._ops.fsync_dir(os.path.dirname(path))

    def ensure_shard_dir(self, directory: str) -> None:
        """Create ``root/ab/cd`` on first use in this process, with durable directory entries.

        NOTE: the parents are fsynced even when the directory already existed: a crash
        between a ``mkdir`` and its parent's fsync leaves a directory whose entry may not
        survive the next power loss.
        """
        if directory in self._known_dirs:
            return
        if self.root not in self._known_dirs:  # start() could not create it (outage)
            self.make_dirs(self.root)
            self._known_dirs.add(self.root)
        for level in (os.path.dirname(directory), directory):
            if level in self._known_dirs:
                continue
            try:
                self._ops.mkdir(level, DIR_MODE)
            except FileExistsError:
                pass
            if self._is_fsync:
                self._ops.fsync_dir(os.path.dirname(level))
            self._known_dirs.add(level)


def is_shard_name(name: str) -> bool:
    """``ab``: a directory name of one level of the layout."""
    return len(name) == 2 and set(name) <= _HEX_DIGITS


def is_key_stem(stem: str) -> bool:
    """A file name (without ``FILE_SUFFIX``) that could be a block key's hex."""
    return bool(stem) and not len(stem) % 2 and set(stem) <= _HEX_DIGITS
