"""The disk tier's restart scan alone (``tiers.disk_recovery``): it reads a directory, sorts
its files into blocks to keep, leftovers, invalid files and strangers, and removes nothing.

``tests/tiers/test_disk.py`` checks what ``DiskStore.recover`` does with the answer.
"""

from __future__ import annotations

from pathlib import Path

from tests.tiers.conftest import make_test_codec, seed_of, seeded_block_meta, seeded_kv_block
from tiers.codec import BlockCodec
from tiers.disk_layout import ShardLayout
from tiers.disk_recovery import scan_root
from tiers.fileops import RealFileOps


def write_block(layout: ShardLayout, codec: BlockCodec, seed: int) -> Path:
    meta = seeded_block_meta(seed)
    path = Path(layout.path_for(meta.key))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(codec.encode(meta, seeded_kv_block(seed)))
    return path


def test_the_scan_sorts_every_file_and_removes_none(tmp_path: Path) -> None:
    codec = make_test_codec()
    layout = ShardLayout(str(tmp_path), RealFileOps(), fsync=False)
    kept = [write_block(layout, codec, seed) for seed in (1, 2)]
    truncated = write_block(layout, codec, 3)
    truncated.write_bytes(truncated.read_bytes()[:-1])
    moved = write_block(layout, codec, 4)
    stranger_dir = Path(layout.path_for(seeded_block_meta(5).key)).parent
    stranger_dir.mkdir(parents=True, exist_ok=True)
    misplaced = stranger_dir / moved.name
    moved.rename(misplaced)
    leftover = kept[0].with_name("half.0123.tmp")
    leftover.write_bytes(b"half a block")
    root_leftover = tmp_path / ".probe.ffff.tmp"
    root_leftover.write_bytes(b"")
    (kept[0].parent / "notes.txt").write_text("not ours")
    (tmp_path / "not-a-shard").mkdir()

    recovery = scan_root(layout, RealFileOps(), codec)

    assert sorted(seed_of(h.meta) for h in recovery.key_to_header.values()) == [1, 2]
    assert sorted(recovery.leftovers) == sorted([str(leftover), str(root_leftover)])
    assert sorted(recovery.invalid) == sorted([(str(truncated), "truncated"),
                                               (str(misplaced), "name")])
    assert recovery.num_unknown_files == 1
    assert recovery.num_read_errors == 0
    for path in (*kept, truncated, misplaced, leftover, root_leftover):
        assert path.exists()


def test_an_empty_or_missing_root_holds_nothing(tmp_path: Path) -> None:
    codec = make_test_codec()
    for root in (tmp_path, tmp_path / "absent"):
        recovery = scan_root(ShardLayout(str(root), RealFileOps(), fsync=False),
                             RealFileOps(), codec)
        assert recovery.key_to_header == {}
        assert recovery.leftovers == [] and recovery.invalid == []
