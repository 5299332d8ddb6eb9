"""The pin manifest (``tiers.pin_manifest``): what a save wrote, a load reads back; whatever an
attacker with the disk (and no deployment secret) or a crash leaves there loads as no pins,
never as an error; a save is atomic -- a kill -9 or a failed rename leaves the previous manifest
whole, and its temp file is one the disk tier's restart scan removes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from policies.base import BlockKey
from tests.tiers.faulty_fs import FaultyFileOps
from tiers.block_mac import derive_mac_key
from tiers.fileops import TEMP_SUFFIX
from tiers.pin_manifest import MAX_MANIFEST_BYTES, PinManifest

MAC_KEY = derive_mac_key(b"pin-manifest-test-secret-0000001")
KEYS = frozenset({BlockKey(bytes([i]) * 16) for i in range(5)})


def saved(tmp_path: Path, keys: frozenset[BlockKey] = KEYS) -> PinManifest:
    manifest = PinManifest(tmp_path / "pins", MAC_KEY)
    assert manifest.save(keys)
    return manifest


def test_a_load_reads_back_what_the_last_save_wrote(tmp_path: Path) -> None:
    manifest = saved(tmp_path)
    assert PinManifest(tmp_path / "pins", MAC_KEY).load() == KEYS
    assert manifest.save(frozenset())
    assert manifest.load() == frozenset()


def test_no_manifest_loads_as_no_pins(tmp_path: Path) -> None:
    assert PinManifest(tmp_path / "pins", MAC_KEY).load() == frozenset()


def test_the_manifest_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    saved(tmp_path)
    assert (tmp_path / "pins").stat().st_mode & 0o777 == 0o600


def test_another_deployments_manifest_loads_as_no_pins(tmp_path: Path) -> None:
    saved(tmp_path)
    other = derive_mac_key(b"another-deployment-secret-000002")
    assert PinManifest(tmp_path / "pins", other).load() == frozenset()


@pytest.mark.parametrize("at", [0, 4, 6, 10, 11, -1], ids=["magic", "version", "count", "length",
                                                           "key", "tag"])
def test_a_manifest_altered_anywhere_loads_as_no_pins(tmp_path: Path, at: int) -> None:
    saved(tmp_path)
    data = bytearray((tmp_path / "pins").read_bytes())
    data[at] ^= 0x01
    (tmp_path / "pins").write_bytes(bytes(data))
    assert PinManifest(tmp_path / "pins", MAC_KEY).load() == frozenset()


@pytest.mark.parametrize("size", [0, 9, 41, None], ids=["empty", "short", "no tag", "cut"])
def test_a_truncated_manifest_loads_as_no_pins(tmp_path: Path, size: int | None) -> None:
    saved(tmp_path)
    data = (tmp_path / "pins").read_bytes()
    (tmp_path / "pins").write_bytes(data[: len(data) - 1 if size is None else size])
    assert PinManifest(tmp_path / "pins", MAC_KEY).load() == frozenset()


def test_a_manifest_over_the_bound_is_refused_unread(tmp_path: Path) -> None:
    with open(tmp_path / "pins", "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)
    assert PinManifest(tmp_path / "pins", MAC_KEY).load() == frozenset()


def test_a_symlink_or_a_directory_in_its_place_loads_as_no_pins(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    saved(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere" / "pins", tmp_path / "pins")
    assert PinManifest(tmp_path / "pins", MAC_KEY).load() == frozenset()
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "pins").mkdir()
    assert PinManifest(tmp_path / "dir" / "pins", MAC_KEY).load() == frozenset()


def test_a_failed_rename_keeps_the_previous_manifest_and_leaves_no_temp_file(
    tmp_path: Path,
) -> None:
    saved(tmp_path)
    ops = FaultyFileOps()
    ops.fail("replace", errno.EIO, on_call=1)
    assert not PinManifest(tmp_path / "pins", MAC_KEY, fileops=ops).save(frozenset())
    assert PinManifest(tmp_path / "pins", MAC_KEY).load() == KEYS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pins"]


def test_a_kill_before_the_rename_leaves_the_previous_manifest_and_a_temp_the_scan_removes(
    tmp_path: Path,
) -> None:
    saved(tmp_path)
    ops = FaultyFileOps()
    ops.fail("replace", errno.EIO, on_call=1)
    ops.fail("unlink", errno.EIO, on_call=1)  # the process died: nothing cleans up
    assert not PinManifest(tmp_path / "pins", MAC_KEY, fileops=ops).save(frozenset())
    assert PinManifest(tmp_path / "pins", MAC_KEY).load() == KEYS
    [temp] = [p.name for p in tmp_path.iterdir() if p.name != "pins"]
    assert temp.startswith("pins.") and temp.endswith(TEMP_SUFFIX)


def test_a_full_disk_is_a_failed_save_not_an_error(tmp_path: Path) -> None:
    ops = FaultyFileOps()
    ops.fail("write", errno.ENOSPC, on_call=1)
    assert not PinManifest(tmp_path / "pins", MAC_KEY, fileops=ops).save(KEYS)
    assert not (tmp_path / "pins").exists()
