"""The disk tier's restart scan: which files under the root are blocks it may serve again.

Every block file costs one small read (its header: MAC, layout, key) and one stat (its size must be
exactly what the header says); block MACs (header and payload) are verified later, on ``get``, so a
restart does not re-read every byte. A file that fails -- not named after its key, in another key's
directory, truncated, a bad MAC -- is reported with the codec's reason word; temp files left by a
crash are reported as leftovers.

The scan only reads. It returns a ``Recovery`` record, and ``DiskStore.recover`` applies it
(removes what must go, counts, rebuilds its index) under its own locks: the scan needs none of
the store's state and can be tested on a directory alone.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from policies.base import BlockKey
from tiers.base import CodecError
from tiers.codec import PREFIX_LEN, BlockCodec, DecodedHeader
from tiers.disk_layout import FILE_SUFFIX, ShardLayout, is_key_stem, is_shard_name
from tiers.fileops import TEMP_SUFFIX, FileOps

logger = logging.getLogger(__name__)

_HEADER_PROBE = 4096
"""Bytes read first: enough for the header of a 256-token block in one read."""


@dataclass(slots=True, kw_only=True)
class Recovery:
    """What one scan found.

    Attributes:
        key_to_header: the verified headers of the block files to keep.
        leftovers: temp files of writes a crash interrupted (to remove).
        invalid: block files that failed, with the codec's reason word (to remove).
        num_unknown_files: files in shard directories that are neither (left alone).
        num_read_errors: directories or files that could not be read (left alone).
    """

    key_to_header: dict[BlockKey, DecodedHeader] = field(default_factory=dict)
    leftovers: list[str] = field(default_factory=list)
    invalid: list[tuple[str, str]] = field(default_factory=list)
    num_unknown_files: int = 0
    num_read_errors: int = 0


def scan_root(layout: ShardLayout, ops: FileOps, codec: BlockCodec) -> Recovery:
    """Scan every shard directory of ``layout`` (see the module docstring)."""
    recovery = Recovery()
    for directory in _shard_dirs(layout, ops, recovery):
        _scan_dir(directory, layout, ops, codec, recovery)
    return recovery


def _shard_dirs(layout: ShardLayout, ops: FileOps, recovery: Recovery) -> list[str]:
    """The shard directories ``root/ab/cd`` (temp files at the root are leftovers too)."""
    leaves: list[str] = []
    for name, is_dir in _list(layout.root, layout, ops, recovery):
        path = os.path.join(layout.root, name)
        if not is_dir:
            if name.endswith(TEMP_SUFFIX):
                recovery.leftovers.append(path)
            continue
        if not is_shard_name(name):
            continue
        for sub, sub_is_dir in _list(path, layout, ops, recovery):
            if sub_is_dir and is_shard_name(sub):
                leaves.append(os.path.join(path, sub))
    return leaves


def _scan_dir(directory: str, layout: ShardLayout, ops: FileOps, codec: BlockCodec,
              recovery: Recovery) -> None:
    for name, is_dir in _list(directory, layout, ops, recovery):
        path = os.path.join(directory, name)
        if is_dir:
            continue
        if name.endswith(TEMP_SUFFIX):
            recovery.leftovers.append(path)
            continue
        if not name.endswith(FILE_SUFFIX):
            recovery.num_unknown_files += 1
            continue
        try:
            header = _check_file(path, name, layout, ops, codec)
        except CodecError as exc:
            recovery.invalid.append((path, exc.reason))
            continue
        except FileNotFoundError:
            continue
        except OSError as exc:
            recovery.num_read_errors += 1
            logger.debug("disk tier %s: cannot read %s: %s", layout.root, name, exc.strerror)
            continue
        recovery.key_to_header[header.meta.key] = header


def _check_file(path: str, name: str, layout: ShardLayout, ops: FileOps,
                codec: BlockCodec) -> DecodedHeader:
    """The file's verified header. Raises CodecError (reason) or OSError."""
    stem = name[: -len(FILE_SUFFIX)]
    if not is_key_stem(stem):
        raise CodecError("name", f"{name} is not named after a block key")
    if layout.path_for(BlockKey(bytes.fromhex(stem))) != path:
        raise CodecError("name", f"{name} is in another key's directory")
    data = ops.read(path, _HEADER_PROBE)
    if len(data) < PREFIX_LEN:
        raise CodecError("truncated", f"{name} is shorter than a header")
    header_len = BlockCodec.header_length(data[:PREFIX_LEN])
    if header_len > len(data):
        data = ops.read(path, header_len)
    header = codec.read_header(data[:header_len])
    if header.meta.key.hex() != stem:
        raise CodecError("name", f"{name} holds block {header.meta.key.hex()}")
    size = ops.size(path)
    if size != header.total_len:
        reason = "truncated" if size < header.total_len else "size"
        raise CodecError(reason, f"{name} is {size} bytes, its header says {header.total_len}")
    return header


def _list(path: str, layout: ShardLayout, ops: FileOps,
          recovery: Recovery) -> list[tuple[str, bool]]:
    try:
        return ops.scandir(path)
    except FileNotFoundError:
        return []
    except OSError as exc:
        recovery.num_read_errors += 1
        logger.warning("disk tier %s: cannot list %s: %s", layout.root, path, exc.strerror)
        return []
