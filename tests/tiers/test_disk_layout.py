"""Where the disk tier puts a block (``tiers.disk_layout``), and that new directories are
made durable: the parent of each directory created is fsynced."""

from __future__ import annotations

import os
from pathlib import Path

from policies.base import BlockKey
from tiers.disk_layout import ShardLayout, is_key_stem, is_shard_name
from tiers.fileops import RealFileOps


class RecordingFileOps(RealFileOps):
    """The real filesystem, remembering which directories were fsynced."""

    def __init__(self) -> None:
        self.fsynced_dirs: list[str] = []

    def fsync_dir(self, path: str) -> None:
        self.fsynced_dirs.append(path)
        super().fsync_dir(path)


def test_a_key_lives_two_shard_levels_down_named_after_its_hex(tmp_path: Path) -> None:
    layout = ShardLayout(str(tmp_path), RealFileOps(), fsync=False)
    assert layout.path_for(BlockKey(bytes.fromhex("abcdef01"))) == str(
        tmp_path / "ab" / "cd" / "abcdef01.kvb")
    assert layout.path_for(BlockKey(b"\x0a")) == str(tmp_path / "0a" / "00" / "0a.kvb")


def test_a_shard_directory_is_created_once_with_its_parents_fsynced(tmp_path: Path) -> None:
    ops = RecordingFileOps()
    root = str(tmp_path / "disk")
    layout = ShardLayout(root, ops, fsync=True)
    directory = os.path.dirname(layout.path_for(BlockKey(bytes.fromhex("abcd"))))
    layout.ensure_shard_dir(directory)
    assert os.path.isdir(directory)
    assert oct(os.stat(directory).st_mode & 0o777) == oct(0o700)
    assert ops.fsynced_dirs == [str(tmp_path), root, os.path.join(root, "ab")]
    layout.ensure_shard_dir(directory)  # known: no syscall at all
    assert len(ops.fsynced_dirs) == 3
    layout.forget_known_dirs()
    layout.ensure_shard_dir(directory)  # exists: the shard levels' entries are fsynced again
    assert ops.fsynced_dirs[3:] == [root, os.path.join(root, "ab")]


def test_names() -> None:
    assert is_shard_name("ab") and not is_shard_name("abc") and not is_shard_name("AB")
    assert is_key_stem("abcd") and not is_key_stem("abc") and not is_key_stem("")
    assert not is_key_stem("zz")
