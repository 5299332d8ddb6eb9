"""DiskStore: durable, verified block files, and what happens when the disk misbehaves.

Everything runs on real files in ``tmp_path``; faults come through the file-ops seam
(``faulty_fs.FaultyFileOps``) or from a real ``kill -9``. Races are frozen with the seam's
pauses, never with sleeps. The rule under test throughout (docs/reliability.md, threat 3): a block
that does not verify is never served -- it is a counted miss, and its file is removed.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pathlib
import pickle
import random
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from policies.base import BlockKey
from tests.tiers.conftest import (
    TEST_BLOCK_TOKENS,
    TEST_LAYOUT,
    TEST_SECRET,
    blocks_equal,
    make_test_codec,
    seed_of,
    seeded_block_meta,
    seeded_kv_block,
)
from tests.tiers.faulty_fs import FaultyFileOps, TailMode
from tests.tiers.xxh3_forgery import encode_format_1, forge_keeping_xxh3
from tiers.base import BlockMeta, BlockStore, TierConfigError
from tiers.codec import BlockCodec, derive_mac_key
from tiers.disk import DiskStore
from tiers.fileops import FileOps, RealFileOps
from tiers.payload import KVBlock, KVLayout

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_NBYTES = TEST_LAYOUT.block_nbytes(TEST_BLOCK_TOKENS)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def block_path(root: Path, key: bytes) -> Path:
    hexkey = key.hex()
    return root / hexkey[:2] / hexkey[2:4] / f"{hexkey}.kvb"


def shard_of(meta: BlockMeta) -> str:
    """A substring of every path the block's write touches (its temp, its file, its dir)."""
    hexkey = meta.key.hex()
    return f"{hexkey[:2]}/{hexkey[2:4]}"


def files_under(root: Path, suffix: str) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{suffix}") if p.is_file())


def make_store(
    root: Path,
    codec: BlockCodec | None = None,
    *,
    fileops: FileOps | None = None,
    start: bool = True,
    **kwargs: Any,
) -> DiskStore:
    store = DiskStore(root, codec or make_test_codec(), fileops=fileops, **kwargs)
    if start:
        store.start()
    return store


def put_seeds(store: DiskStore, seeds: Iterator[int] | range | list[int], **meta_kw: Any) -> None:
    for seed in seeds:
        store.put(seeded_block_meta(seed, **meta_kw), seeded_kv_block(seed))


def assert_serves(store: DiskStore, seed: int, **meta_kw: Any) -> None:
    block = store.get(seeded_block_meta(seed, **meta_kw))
    assert block is not None, f"block {seed} missing"
    assert blocks_equal(block, seeded_kv_block(seed)), f"block {seed} differs"


@pytest.fixture
def disk(tmp_path: Path, block_codec: BlockCodec) -> Iterator[DiskStore]:
    store = make_store(tmp_path / "disk", block_codec)
    yield store
    store.close()


@pytest.fixture
def faulty() -> FaultyFileOps:
    return FaultyFileOps(seed=7)


# ----------------------------------------------------------------------------- basics


def test_disk_store_implements_the_block_store_protocol(disk: DiskStore) -> None:
    assert isinstance(disk, BlockStore)
    assert disk.name == "disk"


def test_round_trip_is_bit_identical_after_flush(disk: DiskStore) -> None:
    put_seeds(disk, range(5))
    assert disk.flush(10)
    assert len(files_under(disk.root, ".kvb")) == 5
    for seed in range(5):
        block = disk.get(seeded_block_meta(seed))
        assert block is not None
        assert blocks_equal(block, seeded_kv_block(seed))
    stats = disk.stats()
    assert (stats.num_blocks, stats.hits, stats.misses, stats.puts) == (5, 5, 0, 5)
    assert stats.notes["puts_written"] == 5


def test_round_trip_with_lz4_compression(tmp_path: Path) -> None:
    codec = BlockCodec(
        mac_key=b"k" * 32, layout=TEST_LAYOUT, block_tokens=TEST_BLOCK_TOKENS, compression="lz4"
    )
    meta, original = seeded_block_meta(3), seeded_kv_block(3)
    with make_store(tmp_path / "disk", codec) as store:
        store.put(meta, original)
        assert store.flush(10)
        block = store.get(meta)
    assert block is not None and blocks_equal(block, original)


def test_missing_block_is_a_counted_miss(disk: DiskStore) -> None:
    assert disk.get(seeded_block_meta(1)) is None
    assert not disk.contains(seeded_block_meta(1).key)
    assert disk.stats().misses == 1


def test_block_is_readable_while_its_write_is_pending(
    tmp_path: Path, faulty: FaultyFileOps
) -> None:
    store = make_store(tmp_path / "disk", fileops=faulty)
    frozen = faulty.pause("open_temp")
    meta, block = seeded_block_meta(1), seeded_kv_block(1)
    store.put(meta, block)
    frozen.wait_reached()
    assert store.contains(meta.key)
    served = store.get(meta)
    assert served is not None and blocks_equal(served, block)
    assert files_under(store.root, ".kvb") == []
    assert store.stats().notes["pending_bytes"] == BLOCK_NBYTES
    frozen.release()
    assert store.flush(10)
    assert store.stats().notes["pending_bytes"] == 0
    assert_serves(store, 1)
    store.close()


def test_pending_block_with_other_tokens_is_a_counted_miss(
    tmp_path: Path, faulty: FaultyFileOps
) -> None:
    store = make_store(tmp_path / "disk", fileops=faulty)
    frozen = faulty.pause("open_temp")
    meta = seeded_block_meta(1)
    store.put(meta, seeded_kv_block(1))
    frozen.wait_reached()
    impostor = BlockMeta(
        key=meta.key,
        parent_key=meta.parent_key,
        namespace_digest=meta.namespace_digest,
        owner=meta.owner,
        tokens=bytes(len(meta.tokens)),
    )
    assert store.get(impostor) is None
    assert store.stats().verification_failures == {"tokens": 1}
    frozen.release()
    store.close()


def test_restart_recovers_headers_and_serves_blocks(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    with make_store(root) as first:
        put_seeds(first, range(6))
    second = make_store(root)
    try:
        headers = second.recover()
        assert sorted(seed_of(h.meta) for h in headers) == list(range(6))
        assert {h.meta for h in headers} == {seeded_block_meta(s) for s in range(6)}
        stats = second.stats()
        assert stats.num_blocks == 6
        assert stats.num_bytes == sum(h.total_len for h in headers)
        assert all(second.contains(seeded_block_meta(s).key) for s in range(6))
        for seed in range(6):
            assert_serves(second, seed)
    finally:
        second.close()


def test_files_are_0600_and_directories_0700(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # even a permissive umask must not widen them
    try:
        with make_store(tmp_path / "disk") as store:
            put_seeds(store, range(3))
    finally:
        os.umask(old_umask)
    root = tmp_path / "disk"
    files = files_under(root, ".kvb")
    assert len(files) == 3
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for directory in (path.parent, path.parent.parent, root):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_files_are_sharded_by_key_hex(disk: DiskStore) -> None:
    metas = [seeded_block_meta(s) for s in range(3)]
    for meta in metas:
        disk.put(meta, seeded_kv_block(seed_of(meta)))
    assert disk.flush(10)
    assert files_under(disk.root, ".kvb") == sorted(block_path(disk.root, m.key) for m in metas)


def test_one_byte_keys_get_padded_shard_names(disk: DiskStore) -> None:
    meta = seeded_block_meta(1)
    short = BlockMeta(
        key=BlockKey(b"\xab"),
        parent_key=meta.parent_key,
        namespace_digest=meta.namespace_digest,
        owner=meta.owner,
        tokens=meta.tokens,
    )
    disk.put(short, seeded_kv_block(1))
    assert disk.flush(10)
    assert files_under(disk.root, ".kvb") == [disk.root / "ab" / "00" / "ab.kvb"]
    block = disk.get(short)
    assert block is not None and blocks_equal(block, seeded_kv_block(1))
    assert [h.meta.key for h in disk.recover()] == [b"\xab"]


def test_put_of_a_present_key_is_not_written_again(tmp_path: Path, faulty: FaultyFileOps) -> None:
    with make_store(tmp_path / "disk", fileops=faulty) as store:
        put_seeds(store, [1])
        assert store.flush(10)
        put_seeds(store, [1, 1])
        assert store.flush(10)
        assert faulty.calls["open_temp"] == 2  # the start-up probe and the one write
        assert store.stats().notes["puts_already_present"] == 2


def test_delete_removes_the_file_and_the_entry(disk: DiskStore) -> None:
    put_seeds(disk, [1, 2])
    assert disk.flush(10)
    key = seeded_block_meta(1).key
    disk.delete(key)
    disk.delete(key)  # twice is fine
    assert not disk.contains(key)
    assert disk.get(seeded_block_meta(1)) is None
    assert not block_path(disk.root, key).exists()
    stats = disk.stats()
    assert (stats.num_blocks, stats.deletes) == (1, 1)
    assert_serves(disk, 2)


def test_delete_during_an_in_flight_write_wins(tmp_path: Path, faulty: FaultyFileOps) -> None:
    store = make_store(tmp_path / "disk", fileops=faulty)
    frozen = faulty.pause("replace")
    meta = seeded_block_meta(1)
    store.put(meta, seeded_kv_block(1))
    frozen.wait_reached()
    store.delete(meta.key)
    frozen.release()
    assert store.flush(10)
    assert not store.contains(meta.key)
    assert store.get(meta) is None
    assert files_under(store.root, ".kvb") == []
    assert files_under(store.root, ".tmp") == []
    store.close()


def test_close_drains_the_queue(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    store = make_store(root)
    put_seeds(store, range(20))
    store.close()
    assert len(files_under(root, ".kvb")) == 20
    store.close()  # idempotent


def test_recover_removes_leftover_temp_files(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    with make_store(root) as store:
        put_seeds(store, [1])
    leftover = block_path(root, seeded_block_meta(1).key).with_name("half.0123.tmp")
    leftover.write_bytes(b"half a block")
    (root / ".probe.ffff.tmp").write_bytes(b"")
    with make_store(root) as store:
        assert store.stats().notes["temp_files_removed"] == 2
        assert files_under(root, ".tmp") == []
        assert_serves(store, 1)


def test_root_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    root.write_bytes(b"not a directory")
    store = make_store(root, start=False)
    with pytest.raises(TierConfigError, match="not a directory"):
        store.start()


def test_put_before_start_is_a_bug(tmp_path: Path) -> None:
    store = make_store(tmp_path / "disk", start=False)
    with pytest.raises(RuntimeError):
        store.put(seeded_block_meta(1), seeded_kv_block(1))


# ----------------------------------------------------------------------------- corruption zoo


def _canary_pickle(canary: Path) -> bytes:
    class Canary:
        def __reduce__(self) -> tuple[object, ...]:
            return (pathlib.Path.touch, (canary,))

    return pickle.dumps(Canary())


def _corrupt(case: str, root: Path, victim: BlockMeta, partner: BlockMeta, canary: Path) -> None:
    """Damage the victim's file as ``case`` says."""
    path = block_path(root, victim.key)
    data = bytearray(path.read_bytes())
    if case == "bit_flip":
        data[-5] ^= 0x10  # in the payload: only the block MAC can tell
        path.write_bytes(data)
    elif case == "xxh3_forgery":  # chosen KV that keeps the payload's xxh3 (format 1's check)
        header_len = BlockCodec.header_length(bytes(data))
        forged, _ = forge_keeping_xxh3(bytes(data[header_len:]), b"\x7f" * BLOCK_NBYTES)
        path.write_bytes(bytes(data[:header_len]) + forged)
    elif case == "format_1":  # the same block, written by the previous format
        codec, mac_key = make_test_codec(), derive_mac_key(TEST_SECRET)
        path.write_bytes(encode_format_1(codec, mac_key, victim, seeded_kv_block(seed_of(victim))))
    elif case == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif case == "swapped":
        other = block_path(root, partner.key)
        swap = path.with_name("swap")
        os.replace(path, swap)
        os.replace(other, path)
        os.replace(swap, other)
    elif case == "other_namespace":
        foreign = BlockMeta(
            key=victim.key,
            parent_key=victim.parent_key,
            namespace_digest=bytes(32),
            owner="tenant-b",
            tokens=victim.tokens,
        )
        path.write_bytes(make_test_codec().encode(foreign, seeded_kv_block(999)))
    elif case == "other_mac":
        other_codec = make_test_codec(secret=b"another-deployment-secret-xyz")
        path.write_bytes(other_codec.encode(victim, seeded_kv_block(seed_of(victim))))
    elif case == "pickle":
        path.write_bytes(_canary_pickle(canary))
    else:  # pragma: no cover
        raise AssertionError(case)


HEADER_LEVEL = {"truncated", "swapped", "other_mac", "pickle", "format_1"}
"""Damage that recovery sees from the header and size alone, before any get."""

ZOO = {
    # case: (reason when found at restart, reason when found while running)
    "bit_flip": ("payload_mac", "payload_mac"),
    "xxh3_forgery": ("payload_mac", "payload_mac"),
    "format_1": ("version", "version"),
    "truncated": ("truncated", "truncated"),
    "swapped": ("name", "key"),
    "other_namespace": ("namespace", "namespace"),
    "other_mac": ("mac", "mac"),
    "pickle": ("magic", "magic"),
}


@pytest.mark.parametrize("when", ["at_restart", "while_running"])
@pytest.mark.parametrize("case", sorted(ZOO))
def test_corrupt_file_is_a_counted_miss_and_is_removed(
    tmp_path: Path, case: str, when: str
) -> None:
    root = tmp_path / "disk"
    canary = tmp_path / "canary"
    victim, partner = seeded_block_meta(0), seeded_block_meta(1)
    controls = range(2, 6)
    store = make_store(root)
    put_seeds(store, range(6))
    assert store.flush(10)
    if when == "at_restart":
        store.close()
        _corrupt(case, root, victim, partner, canary)
        store = make_store(root)
    else:
        _corrupt(case, root, victim, partner, canary)
    try:
        reason = ZOO[case][0 if when == "at_restart" else 1]
        if when == "at_restart" and case in HEADER_LEVEL:
            assert store.stats().verification_failures == {reason: 2 if case == "swapped" else 1}
            assert not store.contains(victim.key)
        assert store.get(victim) is None
        assert store.stats().verification_failures.get(reason, 0) >= 1
        assert not block_path(root, victim.key).exists()
        assert not store.contains(victim.key)
        if case == "swapped":  # the partner holds the victim's bytes: refused too
            assert store.get(partner) is None
            assert not block_path(root, partner.key).exists()
        for seed in controls:
            assert_serves(store, seed)
        assert not canary.exists()
        assert store.stats().misses >= 1
    finally:
        store.close()


# ----------------------------------------------------------------------------- races


@pytest.mark.parametrize("frozen_op", ["write", "fsync", "close", "replace", "fsync_dir"])
def test_read_during_an_in_flight_write_never_sees_a_partial_file(
    tmp_path: Path, faulty: FaultyFileOps, frozen_op: str
) -> None:
    store = make_store(tmp_path / "disk", fileops=faulty)
    put_seeds(store, [0])
    assert store.flush(10)
    frozen = faulty.pause(frozen_op, path_contains=shard_of(seeded_block_meta(1)))
    store.put(seeded_block_meta(1), seeded_kv_block(1))
    frozen.wait_reached()
    final = block_path(store.root, seeded_block_meta(1).key)
    if frozen_op in ("write", "fsync", "close", "replace"):
        assert not final.exists()  # only the temp name exists until the rename

    results: list[KVBlock | None] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            results.append(store.get(seeded_block_meta(1)))
            results.append(store.get(seeded_block_meta(0)))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while len(results) < 50 and time.monotonic() < deadline:
        time.sleep(0.001)
    frozen.release()
    assert store.flush(10)
    stop.set()
    for t in threads:
        t.join(5)
    assert len(results) >= 50
    for result in results:
        assert result is not None  # pending, then on disk: never a miss, never garbage
        assert any(blocks_equal(result, seeded_kv_block(s)) for s in (0, 1))
    assert store.stats().verification_failures == {}
    store.close()


def test_concurrent_puts_gets_and_deletes_stay_consistent(tmp_path: Path) -> None:
    store = make_store(tmp_path / "disk", max_pending_bytes=64 * BLOCK_NBYTES)
    seeds = list(range(16))
    expected = {s: seeded_kv_block(s) for s in seeds}
    metas = {s: seeded_block_meta(s) for s in seeds}
    bad: list[str] = []

    def worker(worker_seed: int) -> None:
        rng = random.Random(worker_seed)
        for _ in range(300):
            seed = rng.choice(seeds)
            action = rng.random()
            if action < 0.4:
                store.put(metas[seed], expected[seed])
            elif action < 0.85:
                block = store.get(metas[seed])
                if block is not None and not blocks_equal(block, expected[seed]):
                    bad.append(f"block {seed} differs")
            elif action < 0.95:
                store.delete(metas[seed].key)
            else:
                store.contains(metas[seed].key)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert store.flush(10)
    assert bad == []
    stats = store.stats()
    on_disk = {p.stem for p in files_under(store.root, ".kvb")}
    indexed = {metas[s].key.hex() for s in seeds if store.contains(metas[s].key)}
    assert on_disk == indexed
    assert stats.num_blocks == len(indexed)
    assert files_under(store.root, ".tmp") == []
    assert stats.verification_failures == {}
    store.close()


def test_backpressure_bounds_pending_bytes_and_put_never_blocks(
    tmp_path: Path, faulty: FaultyFileOps
) -> None:
    store = make_store(tmp_path / "disk", fileops=faulty, max_pending_bytes=int(2.5 * BLOCK_NBYTES))
    frozen = faulty.pause("open_temp")
    putter = threading.Thread(target=put_seeds, args=(store, range(10)))
    putter.start()
    putter.join(5)
    assert not putter.is_alive(), "put blocked while the writer was stuck"
    stats = store.stats()
    assert stats.notes["pending_bytes"] == 2 * BLOCK_NBYTES
    assert stats.notes["dropped_backpressure"] == 8
    assert sorted(store.drain_failed()) == sorted(seeded_block_meta(s).key for s in range(2, 10))
    frozen.release()
    assert store.flush(10)
    assert [store.contains(seeded_block_meta(s).key) for s in range(4)] == [
        True,
        True,
        False,
        False,
    ]
    store.close()


# ----------------------------------------------------------------------------- write errors


@pytest.mark.parametrize(
    "failing_op", ["open_temp", "write", "fsync", "close", "replace", "fsync_dir"]
)
def test_write_error_discards_the_block_without_retry(
    tmp_path: Path, faulty: FaultyFileOps, failing_op: str
) -> None:
    root = tmp_path / "disk"
    store = make_store(root, fileops=faulty)
    victim = seeded_block_meta(1)
    faulty.fail(failing_op, errno.EIO, path_contains=shard_of(victim))
    put_seeds(store, [0, 1, 2])
    assert store.flush(10)
    assert store.drain_failed() == [victim.key]
    assert store.drain_failed() == []
    assert not store.contains(victim.key)
    assert store.get(victim) is None
    assert files_under(root, ".tmp") == []
    assert not block_path(root, victim.key).exists()
    stats = store.stats()
    assert stats.notes["write_errors"] == 1
    assert stats.errors == 1
    assert stats.is_available  # one failed write is not an outage
    calls_after = faulty.calls["open_temp"]
    assert store.flush(10)
    assert faulty.calls["open_temp"] == calls_after  # never retried
    store.close()
    with make_store(root) as restarted:
        assert sorted(seed_of(h.meta) for h in restarted.recover()) == [0, 2]


def test_enospc_stops_writes_with_one_warning_and_reads_continue(
    tmp_path: Path, faulty: FaultyFileOps, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tiers.disk")
    clock = FakeClock()
    store = make_store(tmp_path / "disk", fileops=faulty, clock=clock, retry_after_s=30.0)
    put_seeds(store, [0])
    assert store.flush(10)
    faulty.fail("write", errno.ENOSPC, times=None)
    frozen = faulty.pause("write")
    put_seeds(store, range(1, 6))  # 1 reaches the disk and fails; 2..5 wait behind it
    frozen.wait_reached()
    frozen.release()
    assert store.flush(10)
    put_seeds(store, range(6, 20))  # refused at once: no I/O at all
    assert store.flush(10)

    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "ENOSPC" in warnings[0].getMessage()
    assert faulty.calls["write"] == 2  # block 0, then block 1: nothing after the outage
    stats = store.stats()
    assert not stats.is_available
    assert stats.notes["dropped_unavailable"] == 4 + 14
    assert stats.notes["unavailable_reason"] == "ENOSPC"
    assert sorted(store.drain_failed()) == sorted(seeded_block_meta(s).key for s in range(1, 20))
    assert_serves(store, 0)
    store.close()


def test_enospc_outage_retries_after_the_delay_and_recovers(
    tmp_path: Path, faulty: FaultyFileOps, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="tiers.disk")
    clock = FakeClock()
    store = make_store(tmp_path / "disk", fileops=faulty, clock=clock, retry_after_s=30.0)
    faulty.fail("write", errno.ENOSPC, times=None)
    put_seeds(store, [0])
    assert store.flush(10)
    clock.now += 29.0
    put_seeds(store, [1])
    assert store.stats().notes["dropped_unavailable"] == 1
    clock.now += 1.0
    put_seeds(store, [2])  # retried: the disk is still full
    assert store.flush(10)
    assert not store.stats().is_available
    faulty.clear()
    put_seeds(store, [3])  # within the new delay: still refused
    clock.now += 30.0
    put_seeds(store, [4])
    assert store.flush(10)

    stats = store.stats()
    assert stats.is_available
    assert [store.contains(seeded_block_meta(s).key) for s in range(5)] == [
        False,
        False,
        False,
        False,
        True,
    ]
    assert_serves(store, 4)
    assert stats.notes["unavailable_episodes"] == 1
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    store.close()


def test_read_only_root_starts_degraded_and_serves_what_it_has(
    tmp_path: Path, faulty: FaultyFileOps, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "disk"
    with make_store(root) as store:
        put_seeds(store, [0, 1])
    faulty.fail("open_temp", errno.EROFS, times=None)
    caplog.set_level(logging.WARNING, logger="tiers.disk")
    with make_store(root, fileops=faulty) as store:
        assert not store.stats().is_available
        assert_serves(store, 0)
        assert_serves(store, 1)
        put_seeds(store, [2])
        assert store.stats().notes["dropped_unavailable"] == 1
    assert len(caplog.records) == 1
    assert "EROFS" in caplog.records[0].getMessage()


# ----------------------------------------------------------------------------- crashes


SHARED_DIR = b"\xaa\xbb"  # key prefix: blocks in one shard directory
NEW_DIR = b"\xcc\xdd"


@pytest.mark.parametrize("tail", ["random", "garble", "truncate"])
def test_power_loss_keeps_fsynced_blocks_and_never_serves_a_bad_one(
    tmp_path: Path, tail: TailMode
) -> None:
    root = tmp_path / "disk"
    faulty = FaultyFileOps(seed=11)
    # 1. Durable blocks anywhere.
    with make_store(root, fileops=faulty) as store:
        put_seeds(store, range(0, 8))
    # 2. Blocks written without fsync: some share a directory with later durable writes, some
    #    sit in directories that are never fsynced.
    with make_store(root, fileops=faulty, fsync=False) as store:
        put_seeds(store, range(100, 106), key_prefix=SHARED_DIR)
        put_seeds(store, range(200, 204), key_prefix=NEW_DIR)
    # 3. Durable blocks in the shared directory: its fsync makes the entries of step 2 durable,
    #    not their data.
    store = make_store(root, fileops=faulty)
    put_seeds(store, range(300, 304), key_prefix=SHARED_DIR)
    assert store.flush(10)
    # 4. A durable write caught between write and fsync when the power goes.
    frozen = faulty.pause("fsync")
    put_seeds(store, [400], key_prefix=SHARED_DIR)
    frozen.wait_reached()
    report = faulty.simulate_power_loss(tail=tail)
    frozen.release()
    store.close(timeout_s=10)
    assert report.dropped and report.cut

    after = make_store(root)
    try:
        assert files_under(root, ".tmp") == []
        recovered = {seed_of(h.meta) for h in after.recover()}
        durable = {(s, b"") for s in range(0, 8)} | {(s, SHARED_DIR) for s in range(300, 304)}
        assert {s for s, _ in durable} <= recovered
        for seed, prefix in durable:
            assert_serves(after, seed, key_prefix=prefix)
        at_risk = [(s, SHARED_DIR) for s in (*range(100, 106), 400)]
        at_risk += [(s, NEW_DIR) for s in range(200, 204)]
        for seed, prefix in at_risk:
            block = after.get(seeded_block_meta(seed, key_prefix=prefix))
            assert block is None or blocks_equal(block, seeded_kv_block(seed))
        assert after.stats().verification_failures  # the damaged files were seen, and refused
    finally:
        after.close()


KILL_LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=64, dtype=torch.float32)
KILL_BLOCK_TOKENS = 16
WRITER_SCRIPT = textwrap.dedent(
    """
    import os
    import sys
    import torch
    from tests.tiers.conftest import make_test_codec, seeded_block_meta, seeded_kv_block
    from tiers.disk import DiskStore
    from tiers.payload import KVBlock, KVLayout

    def write_forever(root):
        layout = KVLayout(num_layers=4, kv_heads=2, head_dim=64, dtype=torch.float32)
        codec = make_test_codec(layout=layout, block_tokens=16)
        store = DiskStore(root, codec)
        store.start()
        seed = 0
        while True:
            for _ in range(4):
                store.put(seeded_block_meta(seed, block_tokens=16),
                          seeded_kv_block(seed, layout, 16))
                seed += 1
            store.flush()

    # For each directory read from stdin: fork a writer into it (torch is imported once, here,
    # not once per writer), print its pid, and once it has ended, its wait status.
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                write_forever(line.strip())
            finally:
                os._exit(1)
        print(pid, flush=True)
        print(os.waitpid(pid, 0)[1], flush=True)
    """
)


def test_kill_9_mid_write_never_leaves_a_servable_bad_block(tmp_path: Path) -> None:
    rng = random.Random(5)
    codec = make_test_codec(layout=KILL_LAYOUT, block_tokens=KILL_BLOCK_TOKENS)
    with (tmp_path / "writers.err").open("wb") as err:
        forker = subprocess.Popen(
            [sys.executable, "-c", WRITER_SCRIPT], cwd=REPO_ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=err, text=True,
        )
    assert forker.stdin is not None and forker.stdout is not None
    try:
        for run in range(5):
            root = tmp_path / f"run{run}"
            forker.stdin.write(f"{root}\n")
            forker.stdin.flush()
            writer = int(forker.stdout.readline())
            try:
                want = 5 + rng.randrange(20)
                deadline = time.monotonic() + 20
                while len(files_under(root, ".kvb")) < want:
                    assert time.monotonic() < deadline, (
                        "the writer made no progress\n"
                        + (tmp_path / "writers.err").read_text(errors="replace"))
                    time.sleep(0.005)
                time.sleep(rng.random() * 0.02)
                seen_before_kill = {p.stem for p in files_under(root, ".kvb")}
            finally:
                with contextlib.suppress(ProcessLookupError):  # (it died on its own: see below)
                    os.kill(writer, signal.SIGKILL)
                status = int(forker.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

            with DiskStore(root, codec) as store:
                headers = store.recover()
                assert files_under(root, ".tmp") == []
                recovered = {h.meta.key.hex() for h in headers}
                assert seen_before_kill <= recovered  # every renamed file is whole
                for header in headers:
                    seed = seed_of(header.meta)
                    meta = seeded_block_meta(seed, block_tokens=KILL_BLOCK_TOKENS)
                    assert header.meta == meta
                    block = store.get(meta)
                    assert block is not None
                    assert blocks_equal(block, seeded_kv_block(seed, KILL_LAYOUT,
                                                               KILL_BLOCK_TOKENS))
                assert store.stats().verification_failures == {}
    finally:
        forker.stdin.close()
        try:
            forker.wait(10)
        except subprocess.TimeoutExpired:
            forker.kill()
            forker.wait(10)
        forker.stdout.close()


def test_real_file_ops_reads_at_most_max_bytes(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"0123456789")
    ops = RealFileOps()
    assert ops.read(str(path), 4) == b"0123"
    assert ops.read(str(path), None) == b"0123456789"
    assert ops.size(str(path)) == 10
    fd, temp = ops.open_temp(str(tmp_path), "x")
    try:
        assert temp.endswith(".tmp") and stat.S_IMODE(os.stat(temp).st_mode) == 0o600
        ops.write(fd, memoryview(b"abc"))
    finally:
        ops.close(fd)
    assert Path(temp).read_bytes() == b"abc"


def test_real_file_ops_refuses_symlinks_and_fifos(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"secret")
    (tmp_path / "link").symlink_to(target)
    os.mkfifo(tmp_path / "fifo")
    ops = RealFileOps()
    with pytest.raises(OSError) as link_error:
        ops.read(str(tmp_path / "link"), None)
    assert link_error.value.errno == errno.ELOOP
    with pytest.raises(OSError) as fifo_error:
        ops.read(str(tmp_path / "fifo"), None)  # must not block
    assert fifo_error.value.errno == errno.EINVAL


def test_faulty_fs_power_loss_follows_fsyncs_across_renames(tmp_path: Path) -> None:
    ops = FaultyFileOps(seed=3)
    ops.fail(op="fsync", errno=errno.EIO, on_call=3, times=1)
    kept_dir, lost_dir = str(tmp_path / "kept"), str(tmp_path / "lost")
    for directory in (kept_dir, lost_dir):
        ops.mkdir(directory, 0o700)
    ops.fsync_dir(str(tmp_path))

    def write(directory: str, name: str, data: bytes, *, sync: bool) -> str:
        fd, temp = ops.open_temp(directory, name)
        try:
            ops.write(fd, data)
            if sync:
                ops.fsync(fd)
        finally:
            ops.close(fd)
        final = os.path.join(directory, name)
        ops.replace(temp, final)
        return final

    synced = write(kept_dir, "synced", b"a" * 100, sync=True)
    unsynced = write(kept_dir, "unsynced", b"b" * 100, sync=False)
    ops.fsync_dir(kept_dir)
    undirsynced = write(lost_dir, "entry-not-synced", b"c" * 100, sync=True)
    with pytest.raises(OSError) as failed:
        write(kept_dir, "third-fsync", b"d", sync=True)
    assert failed.value.errno == errno.EIO

    report = ops.simulate_power_loss(tail="truncate")
    assert Path(synced).read_bytes() == b"a" * 100
    assert Path(unsynced).read_bytes() == b""
    assert not Path(undirsynced).exists()
    assert undirsynced in report.dropped
    with pytest.raises(OSError):
        ops.read(synced, None)  # the machine is off
