"""The contract every store keeps (``tiers.base.BlockStore``), as one suite of tests that a
test module runs over the kinds it names: ``StoreContract`` needs only a ``case`` fixture, a
``StoreCase`` opened through a kind (``open_case``), as cachetools' ``CacheTestMixin`` runs one
suite over every cache class.

What it holds every kind to: a block put is served (bit for bit, or within its format's
rounding for a lossy kind) and ``contains``; a miss is None and counted; a delete takes it away
and is counted; the counters move by exactly what was done; a block read into a given page is
that page; a block with a TTL is served, and a store that reports expiries reports its TTL;
readers and writers on many threads at once lose nothing. Where a kind's bytes leave the
process (a file, a Redis value), a corrupted or forged copy is a counted miss and is removed:
``TAMPER`` names how to change a kind's stored bytes, and every kind whose bytes leave the
process must have an entry (a memory kind's never do: nothing outside the process can reach
them).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.core.admin_reports import StoreReport
from gateway.core.quantization import EXACT, parse_quantization
from tests.tiers.conftest import (
    TEST_BLOCK_TOKENS,
    TEST_LAYOUT,
    TEST_SECRET,
    blocks_equal,
    seeded_block_meta,
    seeded_kv_block,
)
from tiers.base import BlockExpiry, BlockMeta, BlockStore
from tiers.codec import BlockCodec, derive_mac_key
from tiers.kinds.base import TierContext
from tiers.kinds.registry import TIER_KINDS
from tiers.page_pool import PagedBlock, PagePool
from tiers.payload import KVBlock

BUDGET_BYTES = 1 << 20
NUM_THREADS = 4
BLOCKS_PER_THREAD = 8


@dataclass(slots=True, kw_only=True)
class StoreCase:
    """A store opened through its kind, and what the suite needs to know of it."""

    kind: str
    store: BlockStore
    config: Any
    pool: PagePool
    root: Path
    """Where a persistent kind keeps its files (its ``path``)."""
    redis: Any = None
    """The ``RedisServer`` a remote kind talks to."""

    @property
    def is_exact(self) -> bool:
        return self.config.lossy_format is None

    @property
    def counts_blocks(self) -> bool:
        """A remote store leaves ``num_blocks`` to the server (shared by every replica)."""
        return not TIER_KINDS[self.kind].is_remote

    def settle(self) -> None:
        """Wait for queued writes (a disk tier writes on a thread of its own)."""
        flush = getattr(self.store, "flush", None)
        if flush is not None:
            assert flush(timeout_s=10)


def test_context(pool: PagePool) -> TierContext:
    """What every tier of the suite shares: the tier tests' layout, block size and secret."""
    codecs: dict[str | None, BlockCodec] = {}

    def codec_for(quantize: str | None) -> BlockCodec:
        if quantize not in codecs:
            codecs[quantize] = BlockCodec(
                mac_key=derive_mac_key(TEST_SECRET), layout=TEST_LAYOUT,
                block_tokens=TEST_BLOCK_TOKENS, quantize=parse_quantization(quantize or EXACT))
        return codecs[quantize]

    return TierContext(layout=TEST_LAYOUT, block_tokens=TEST_BLOCK_TOKENS,
                       device=torch.device("cpu"), pool=pool, codec_for=codec_for,
                       write_queue_bytes=BUDGET_BYTES, clock=time.monotonic)


def open_case(kind: str, tmp_path: Path, redis: Any = None) -> Iterator[StoreCase]:
    """Open a store of ``kind`` through the registry, with a small budget, a directory of its
    own and the Redis server where its record has such keys; close it after."""
    config_type = TIER_KINDS[kind].config_type
    names = {f.name for f in fields(config_type)}
    values: dict[str, object] = {}
    if "bytes" in names:
        values["bytes"] = BUDGET_BYTES
    if "path" in names:
        values["path"] = tmp_path / kind
    if "url" in names:
        assert redis is not None, f"the {kind} kind needs a Redis server"
        values["url"] = redis.url
    config = config_type(**values)
    assert config.problems() == []
    pool = PagePool(TEST_LAYOUT, page_tokens=TEST_BLOCK_TOKENS, num_pages=128)
    store = TIER_KINDS[kind].open(config, test_context(pool))
    start = getattr(store, "start", None)
    if start is not None:
        start()
    try:
        yield StoreCase(kind=kind, store=store, config=config, pool=pool, root=tmp_path / kind,
                        redis=redis)
    finally:
        store.close()


def _flip_file(case: StoreCase, meta: BlockMeta) -> None:
    [path] = case.root.rglob(f"{meta.key.hex()}*")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload's last byte: only the MAC over it can tell
    path.write_bytes(bytes(data))


def _flip_value(case: StoreCase, meta: BlockMeta) -> None:
    key = case.store.redis_key(meta)  # type: ignore[attr-defined]
    value = bytearray(case.redis.command("GET", key))
    value[-1] ^= 0xFF
    case.redis.command("SET", key, bytes(value))


TAMPER: dict[str, Callable[[StoreCase, BlockMeta], None]] = {"disk": _flip_file,
                                                             "redis": _flip_value}
"""How to change a stored block's bytes, for each kind whose bytes leave the process."""


def _served(case: StoreCase, got: KVBlock | None, want: KVBlock) -> bool:
    if got is None:
        return False
    if case.is_exact:
        return blocks_equal(got, want)
    stacked = [torch.stack([torch.stack(kv) for kv in zip(b.keys, b.values, strict=True)])
               for b in (got, want)]
    return got.quantization == case.config.lossy_format and torch.allclose(
        stacked[0].float(), stacked[1].float(), atol=0.1)


def _delta(before: StoreReport, after: StoreReport, name: str) -> int:
    return int(getattr(after, name)) - int(getattr(before, name))


class StoreContract:
    """The suite; a subclass provides the ``case`` fixture."""

    def test_a_block_put_is_served_and_contained(self, case: StoreCase) -> None:
        meta, block = seeded_block_meta(1), seeded_kv_block(1)
        case.store.put(meta, block)
        case.settle()
        assert case.store.contains(meta.key)
        assert _served(case, case.store.get(meta), block)

    def test_a_miss_is_none_and_counted(self, case: StoreCase) -> None:
        before = case.store.stats()
        assert case.store.get(seeded_block_meta(2)) is None
        assert not case.store.contains(seeded_block_meta(2).key)
        after = case.store.stats()
        assert (_delta(before, after, "misses"), _delta(before, after, "hits")) == (1, 0)

    def test_a_delete_takes_the_block_away_and_is_counted(self, case: StoreCase) -> None:
        meta = seeded_block_meta(3)
        case.store.put(meta, seeded_kv_block(3))
        case.settle()
        before = case.store.stats()
        case.store.delete(meta.key)
        case.settle()
        assert not case.store.contains(meta.key)
        assert case.store.get(meta) is None
        after = case.store.stats()
        assert _delta(before, after, "deletes") == 1
        if case.counts_blocks:
            assert _delta(before, after, "num_blocks") == -1
            assert _delta(before, after, "num_bytes") < 0

    def test_the_counters_move_by_what_was_done(self, case: StoreCase) -> None:
        before = case.store.stats()
        metas = [seeded_block_meta(seed) for seed in range(10, 13)]
        for seed, meta in zip(range(10, 13), metas, strict=True):
            case.store.put(meta, seeded_kv_block(seed))
        case.settle()
        for meta in metas[:2]:
            assert case.store.get(meta) is not None
        after = case.store.stats()
        assert {name: _delta(before, after, name) for name in ("puts", "hits", "misses",
                                                                "deletes", "errors")} == {
            "puts": 3, "hits": 2, "misses": 0, "deletes": 0, "errors": 0}
        if case.counts_blocks:
            assert _delta(before, after, "num_blocks") == 3
            assert _delta(before, after, "num_bytes") > 0
        assert after.verification_failures == before.verification_failures

    def test_a_report_stays_as_it_was_taken_while_the_store_counts_on(
            self, case: StoreCase) -> None:
        report = case.store.stats()
        taken = replace(report, verification_failures=dict(report.verification_failures),
                        notes=dict(report.notes))
        meta = seeded_block_meta(20)
        case.store.put(meta, seeded_kv_block(20))
        case.settle()
        assert case.store.get(meta) is not None
        assert case.store.get(seeded_block_meta(21)) is None
        assert report == taken
        assert (case.store.stats().puts, case.store.stats().hits) == (report.puts + 1,
                                                                     report.hits + 1)

    def test_a_corrupted_or_forged_copy_is_a_counted_miss_and_removed(
            self, case: StoreCase) -> None:
        is_persistent = TIER_KINDS[case.kind].is_remote or "path" in {
            f.name for f in fields(case.config)}
        if case.kind not in TAMPER:
            assert not is_persistent, f"the {case.kind} kind's bytes leave the process: add " \
                                      "how to change them to TAMPER"
            pytest.skip(f"the {case.kind} kind's bytes never leave the process")
        meta = seeded_block_meta(4)
        case.store.put(meta, seeded_kv_block(4))
        case.settle()
        TAMPER[case.kind](case, meta)
        before = case.store.stats()
        assert case.store.get(meta) is None
        after = case.store.stats()
        assert sum(after.verification_failures.values()) == sum(
            before.verification_failures.values()) + 1
        assert not case.store.contains(meta.key)

    def test_a_block_read_into_a_given_page_is_that_page(self, case: StoreCase) -> None:
        meta, block = seeded_block_meta(5), seeded_kv_block(5)
        case.store.put(meta, block)
        case.settle()
        page = case.pool.block(case.pool.allocate(zeroed=True))
        fetch_chain = getattr(case.store, "fetch_chain", None)
        if fetch_chain is not None:
            [found] = fetch_chain([meta], into=[page])
            got = None if found is None else found[0]
        elif "into" in inspect.signature(case.store.get).parameters:
            got = case.store.get(meta, into=page)  # type: ignore[call-arg]
        else:
            pytest.skip(f"the {case.kind} kind serves its blocks where they lie (no reads "
                        "into pages)")
        assert isinstance(got, PagedBlock) and got.page == page.page
        assert _served(case, got, block)

    def test_a_block_with_a_ttl_is_served_and_its_ttl_reported(self, case: StoreCase) -> None:
        expiry = BlockExpiry(ttl_s=60.0, expires_at=time.time() + 60.0)
        meta = replace(seeded_block_meta(6), expiry=expiry)
        case.store.put(meta, seeded_kv_block(6))
        case.settle()
        assert _served(case, case.store.get(meta), seeded_kv_block(6))
        fetch_chain = getattr(case.store, "fetch_chain", None)
        if fetch_chain is not None:
            [found] = fetch_chain([meta])
            assert found is not None and found[1] is not None and found[1].ttl_s == 60.0

    def test_readers_and_writers_at_once_lose_nothing(self, case: StoreCase) -> None:
        before = case.store.stats()
        start = threading.Barrier(NUM_THREADS)
        failures: list[str] = []

        def work(thread: int) -> None:
            seeds = range(100 + thread * BLOCKS_PER_THREAD, 100 + (thread + 1) * BLOCKS_PER_THREAD)
            start.wait()
            for seed in seeds:
                case.store.put(seeded_block_meta(seed), seeded_kv_block(seed))
                other = 100 + ((thread + 1) % NUM_THREADS) * BLOCKS_PER_THREAD
                case.store.get(seeded_block_meta(other))  # a hit or a miss, never a fault
            case.settle()
            for seed in seeds:
                if not _served(case, case.store.get(seeded_block_meta(seed)),
                               seeded_kv_block(seed)):
                    failures.append(f"seed {seed}")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(NUM_THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not failures
        after = case.store.stats()
        num_blocks = NUM_THREADS * BLOCKS_PER_THREAD
        assert _delta(before, after, "puts") == num_blocks
        assert _delta(before, after, "hits") + _delta(before, after, "misses") == 2 * num_blocks
        if case.counts_blocks:
            assert _delta(before, after, "num_blocks") == num_blocks
