"""The tier hierarchy: moves block bytes between ordered stores and learns what a load costs.

Local tiers are ordered fastest first (device, host, disk); an optional *remote* tier (Redis) is
shared by every replica and is consulted by chain key when the local tiers miss. This module
only moves bytes and keeps figures; what to promote, demote or evict is decided by the prefix
cache, which owns the index and the policies.

Load bandwidth: every read is timed, and each tier (the remote one too) keeps an exponentially
weighted estimate of its bytes per second. A block whose load would cost more than recomputing
it is worth recomputing (peers shipped disk tiers whose hits were slower than a fresh prefill);
the prefix cache asks ``worth_loading`` before loading. A tier judged slow is not read, so its
estimate would never change again: once per ``reprobe_interval_s`` one load from it is let
through anyway (a *probe*: the prefix cache makes it one block, ``is_judged_slow``), and a
probe's measurement replaces the stale estimate, so a tier that got fast again (a disk that
stopped thrashing, a Redis whose network recovered) is used again at once, and one that is
still slow is judged slow again for another interval, counted from the probe's measurement.

Remote writes go through a background thread with a bounded queue, so a slow or dead Redis never
sits on the request path; local disk writes are queued by the disk store itself.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import cast

from gateway.core.admin_reports import StoreReport
from policies.base import BlockKey
from policies.rate import TenantRates
from tiers.base import (
    BlockExpiry,
    BlockMeta,
    BlockStore,
    ChainPageReader,
    PageReader,
    RemoteStore,
)
from tiers.page_pool import PagedBlock, PagePool, PoolExhausted, await_arrival
from tiers.payload import KVBlock

logger = logging.getLogger(__name__)

REMOTE = "redis"


@dataclass(slots=True)
class Bandwidth:
    """Exponentially weighted estimate of a tier's load bandwidth (bytes per second)."""

    bytes_per_s: float | None = None
    alpha: float = 0.2
    num_samples: int = 0

    def record(self, num_bytes: int, seconds: float) -> None:
        if seconds <= 0 or num_bytes <= 0:
            return
        sample = num_bytes / seconds
        self.num_samples += 1
        if self.bytes_per_s is None:
            self.bytes_per_s = sample
        else:
            self.bytes_per_s += self.alpha * (sample - self.bytes_per_s)


def takes_pages(method: Callable[..., object]) -> bool:
    """Whether a store's ``get`` (``get_many``) reads into pages it is given: it takes ``into``
    (``tiers.base.PageReader``, ``ChainPageReader``)."""
    return "into" in inspect.signature(method).parameters


class RemoteWriter:
    """One background thread that writes chains to the remote store, oldest first.

    Bounded by bytes: when the remote is slower than the request rate, new writes are dropped
    (counted), never queued without limit and never waited for; of a chain bigger than the room
    left, its head is written and the rest dropped. With a ``budget``, each owner
    (tenant) may write only so many bytes per second: past it, the rest of a chain is dropped
    (counted per owner; a chain's head is kept, so no child is written without its parent),
    so that one tenant's flood cannot fill the shared Redis and push the others' blocks out.
    Owners in ``exempt_owners`` (the shared scope, which only admins write) are not budgeted.
    """

    def __init__(self, store: BlockStore, *, max_pending_bytes: int = 256 << 20,
                 budget: TenantRates | None = None,
                 exempt_owners: frozenset[str] = frozenset()) -> None:
        self._store = store
        self._max_pending_bytes = max_pending_bytes
        self._budget = budget
        self._exempt = exempt_owners
        self.owner_to_num_over_budget: dict[str, int] = {}
        self._queue: queue.Queue[list[tuple[BlockMeta, KVBlock]] | None] = queue.Queue()
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.num_dropped = 0
        self.num_written = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvgate-remote-writer", daemon=True)
        self._thread.start()

    def submit(self, items: list[tuple[BlockMeta, KVBlock]]) -> bool:
        if self._budget is not None:
            items = self._within_budget(items, self._budget)
            if not items:
                return False
        with self._lock:
            if self._thread is None:
                self.num_dropped += len(items)
                return False
            # The chain's head that fits: a parent is worth having without its children (a
            # replica loads the longest prefix present), a child without its parent is not.
            room = self._max_pending_bytes - self._pending_bytes
            size = num_kept = 0
            for _, block in items:
                if size + block.nbytes > room:
                    break
                size += block.nbytes
                num_kept += 1
            self.num_dropped += len(items) - num_kept
            if not num_kept:
                return False
            self._pending_bytes += size
        self._queue.put(items[:num_kept])
        return True

    def _within_budget(self, items: list[tuple[BlockMeta, KVBlock]],
                       budget: TenantRates) -> list[tuple[BlockMeta, KVBlock]]:
        kept = []
        over: set[str] = set()
        for meta, block in items:
            owner = meta.owner
            if owner not in self._exempt and (owner in over
                                              or not budget.try_take(owner, block.nbytes)):
                over.add(owner)
                with self._lock:
                    self.owner_to_num_over_budget[owner] = (
                        self.owner_to_num_over_budget.get(owner, 0) + 1)
                continue
            kept.append((meta, block))
        return kept

    @property
    def num_over_budget(self) -> int:
        with self._lock:
            return sum(self.owner_to_num_over_budget.values())

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted write is done; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._idle:
            while self._pending_bytes:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread is None:
            return
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        while True:
            items = self._queue.get()
            if items is None:
                return
            try:
                self._store.put_many(items)
                self.num_written += len(items)
            finally:
                with self._idle:
                    self._pending_bytes -= sum(block.nbytes for _, block in items)
                    self._idle.notify_all()


@dataclass(frozen=True, slots=True, kw_only=True)
class TierLevel:
    """One local tier: its name and its store (fastest first in a hierarchy).

    Attributes:
        parallel_reads: blocks of one load read at once from this tier (``read_many``): for a
            disk, file reads and MAC checks of a chain's blocks overlap; 1 reads in order.
    """

    name: str
    store: BlockStore
    parallel_reads: int = 1


class TierHierarchy:
    """Ordered local stores, an optional remote store, and their load-cost estimates.

    Args:
        levels: local tiers, fastest first (e.g. device, host, disk).
        remote: the store shared by replicas (Redis), or None.
        remote_max_pending_bytes: bytes queued for the remote at most (more are dropped).
        remote_budget: bytes per second each owner may write to the remote (None: no limit).
        remote_exempt_owners: owners the budget does not apply to.
        reprobe_interval_s: a tier judged slower than recomputing gets one probing load per
            this many seconds (see the module docstring).
        skip_slow_tiers: False loads from every tier whatever the estimates say (recomputing
            is then never chosen over a load: for a busy GPU whose compute serves everyone,
            or for tests of what a tier serves).
        clock: time source for load timing.
    """

    def __init__(
        self,
        levels: Sequence[TierLevel],
        *,
        remote: RemoteStore | None = None,
        remote_max_pending_bytes: int = 256 << 20,
        reprobe_interval_s: float = 10.0,
        skip_slow_tiers: bool = True,
        remote_budget: TenantRates | None = None,
        remote_exempt_owners: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not reprobe_interval_s > 0:
            raise ValueError(f"reprobe_interval_s must be > 0, got {reprobe_interval_s}")
        names = [level.name for level in levels]
        if len(set(names)) != len(names) or REMOTE in names:
            raise ValueError(f"local tier names must be unique and not {REMOTE!r}: {names}")
        self._levels = {level.name: level for level in levels}
        self.names = tuple(names)
        self.remote = remote
        self._writer = (
            RemoteWriter(remote, max_pending_bytes=remote_max_pending_bytes,
                         budget=remote_budget, exempt_owners=remote_exempt_owners)
            if remote else None
        )
        self._clock = clock
        self._bandwidth = {name: Bandwidth() for name in (*names, REMOTE)}
        self._reprobe_interval_s = reprobe_interval_s
        self._skip_slow_tiers = skip_slow_tiers
        self._lock = threading.Lock()  # the slow-tier bookkeeping below
        self._slow_since: dict[str, float] = {}  # tier -> when it was judged slow / last probed
        self._probing: set[str] = set()  # tiers whose next timed load is a probe
        self._num_skipped_slow = {name: 0 for name in (*names, REMOTE)}
        self._num_probes = {name: 0 for name in (*names, REMOTE)}
        self._block_bytes: int | None = None  # payload size of one block, learned on reads
        self._readers = {
            level.name: ThreadPoolExecutor(max_workers=level.parallel_reads,
                                           thread_name_prefix=f"kvgate-{level.name}-read")
            for level in levels if level.parallel_reads > 1}
        self._reads_pages = {level.name: (takes_pages(level.store.get),
                                          takes_pages(level.store.get_many))
                             for level in levels}
        """Per tier: whether a block, and a chain at once, can be read into given pages."""

    def start(self) -> None:
        if self._writer is not None:
            self._writer.start()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        for readers in self._readers.values():
            readers.shutdown(wait=True)
        for level in self._levels.values():
            level.store.close()
        if self.remote is not None:
            self.remote.close()

    def store(self, tier: str) -> BlockStore:
        return self._levels[tier].store

    def below(self, tier: str) -> str | None:
        """The next slower local tier (where ``tier`` demotes to), or None for the last."""
        index = self.names.index(tier)
        return self.names[index + 1] if index + 1 < len(self.names) else None

    # ---- bytes ----------------------------------------------------------------------------

    def read(self, tier: str, meta: BlockMeta) -> KVBlock | None:
        """Load one block from a local tier, timing it; None if absent or unverifiable."""
        start = self._clock()
        block = self._levels[tier].store.get(meta)
        if block is not None:
            with self._lock:
                self._block_bytes = block.nbytes
            self._record_load(tier, block.nbytes, self._clock() - start)
        return block

    def read_many(self, tier: str, metas: Sequence[BlockMeta], *,
                  into_tier: str | None = None) -> list[KVBlock | None]:
        """Load several blocks of one local tier (a run of a chain), in order, timed together;
        each None if absent or unverifiable. Up to the level's ``parallel_reads`` at once.

        ``into_tier``: as for ``fetch_remote``: a disk tier's blocks are decoded into that
        tier's free pages, a host tier's copied (or dequantized) into them; a block of another
        tier is served as it is.
        """
        if not metas:
            return []
        start = self._clock()
        readers = self._readers.get(tier)
        store = self._levels[tier].store
        staged = []
        reads_block, reads_chain = self._reads_pages[tier]
        if reads_block:
            staged = self._staging_pages(into_tier, len(metas))
            get_into = cast(PageReader, store).get
        if reads_chain:  # one lock, one fence for the chain (the host tier)
            blocks = cast(ChainPageReader, store).get_many(metas, into=staged)
        elif staged:
            def read(i: int) -> KVBlock | None:
                return get_into(metas[i], into=staged[i])

            indices = range(len(metas))
            blocks = list(readers.map(read, indices) if readers is not None
                          else map(read, indices))
        elif readers is not None and len(metas) > 1:
            blocks = list(readers.map(store.get, metas))
        else:
            blocks = store.get_many(metas)
        got = [block for block in blocks if block is not None]
        if got:
            with self._lock:
                self._block_bytes = got[0].nbytes
            self._record_load(tier, sum(block.nbytes for block in got), self._clock() - start)
        return blocks

    def _record_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        with self._lock:
            is_probe = tier in self._probing
            self._probing.discard(tier)
            if is_probe and tier in self._slow_since:
                self._slow_since[tier] = self._clock()  # the next interval counts from here
        bandwidth = self._bandwidth[tier]
        if is_probe:
            # The estimate is stale by a whole interval: the probe's measurement replaces it.
            bandwidth.bytes_per_s = None
        bandwidth.record(num_bytes, seconds)

    def write(self, tier: str, meta: BlockMeta, block: KVBlock) -> None:
        await_arrival(block)  # a page a host hit may still be filling, layer by layer
        self._levels[tier].store.put(meta, block)

    def delete(self, tier: str, key: BlockKey) -> None:
        self._levels[tier].store.delete(key)

    def fetch_remote(
        self, metas: Sequence[BlockMeta], *, into_tier: str | None = None
    ) -> list[tuple[KVBlock, BlockExpiry | None]]:
        """The longest prefix of ``metas`` (a chain) that the remote store holds and verifies,
        each block with the expiry its header carries.

        ``into_tier``: the tier the blocks are meant for. Where it is a pool of pages (the
        device tier), each block is decoded straight into a free page and comes back as that
        page, which the tier then keeps as it is (``DeviceStore.put``): no float buffer of its
        own and no copy into a page after it (for a 2k-token int8 chain of SmolLM2 on a CPU,
        94 MB written once instead of three times; on a GPU an int8 block goes up as int8 and
        is dequantized there, ``tiers.kv_quant.dequantize``). Pages are taken only while the
        pool has twice the chain's free; a page whose block is not found goes back at once.
        """
        if self.remote is None or not metas:
            return []
        start = self._clock()
        staged = self._staging_pages(into_tier, len(metas))
        got = self.remote.fetch_chain(metas, into=staged)
        hits: list[tuple[KVBlock, BlockExpiry | None]] = []
        for one in got:
            if one is None:
                break
            hits.append(one)
        if hits:
            with self._lock:
                self._block_bytes = hits[0][0].nbytes
            self._record_load(REMOTE, sum(b.nbytes for b, _ in hits), self._clock() - start)
        return hits

    def _staging_pages(self, tier: str | None, count: int) -> list[PagedBlock]:
        """``count`` free pages of ``tier``'s pool to decode into, as blocks; [] where the tier
        has no pool or the pool has fewer than twice that many free pages."""
        store = self._levels[tier].store if tier is not None else None
        pool = getattr(store, "pool", None)  # the device tier's pages (``DeviceStore.pool``)
        if not isinstance(pool, PagePool) or pool.num_free < 2 * count:
            return []
        try:
            return [pool.block(pool.allocate(zeroed=False)) for _ in range(count)]
        except PoolExhausted:  # taken meanwhile: those allocated go back with their handles
            return []

    def refresh_remote_expiry(self, metas: Sequence[BlockMeta]) -> None:
        """Give these blocks' remote copies the expiry their metas say (pin, unpin).

        Queued writes are flushed first: a block pinned right after it was stored (a warm
        with pin) must not get its ``PX`` back from a write that lands after the ``PERSIST``.
        """
        if self.remote is None:
            return
        if self._writer is not None:
            self._writer.flush(timeout_s=30.0)
        self.remote.refresh_expiry(metas)

    def write_remote(self, items: list[tuple[BlockMeta, KVBlock]]) -> bool:
        """Queue a chain (or the head of it the queue has room for) for the remote store; False
        if there is none or the queue is full."""
        if self._writer is None or not items:
            return False
        for _, block in items:
            await_arrival(block)  # read on the writer's thread, after what is queued here
        return self._writer.submit(items)

    def forget_remote(self, metas: Sequence[BlockMeta], *,
                      min_idle_s: float | None = None) -> None:
        """Delete these blocks (with ``min_idle_s``: those idle that long) from the remote
        store (admin eviction reaching every replica).

        Queued writes are flushed first, so that a block queued before the eviction does not
        reappear after it.
        """
        if self.remote is None:
            return
        if self._writer is not None:
            self._writer.flush(timeout_s=30.0)
        self.remote.delete_metas(metas, min_idle_s=min_idle_s)

    def remove_remote_where(self, *, namespace_digest: bytes | None = None,
                            key: BlockKey | None = None, min_idle_s: float | None = None) -> int:
        """Remove the remote blocks a selection names (``RemoteStore.remove_where``), after
        the queued writes; how many keys went."""
        if self.remote is None:
            return 0
        if self._writer is not None:
            self._writer.flush(timeout_s=30.0)
        return self.remote.remove_where(namespace_digest=namespace_digest, key=key,
                                        min_idle_s=min_idle_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for queued remote writes and local disk writes (graceful shutdown, tests)."""
        ok = True
        if self._writer is not None:
            ok = self._writer.flush(timeout_s)
        for level in self._levels.values():
            flush = getattr(level.store, "flush", None)
            if callable(flush):
                ok = bool(flush(timeout_s)) and ok
        return ok

    def drain_failed(self) -> dict[str, list[BlockKey]]:
        """Per tier, the keys whose queued writes failed or were dropped since the last call
        (the disk tier reports them), so that the index can forget those copies."""
        failed: dict[str, list[BlockKey]] = {}
        for name, level in self._levels.items():
            drain = getattr(level.store, "drain_failed", None)
            if callable(drain):
                keys = list(drain())
                if keys:
                    failed[name] = keys
        return failed

    # ---- figures --------------------------------------------------------------------------

    def estimate_load_s(self, tier: str, num_bytes: int) -> float | None:
        """Expected seconds to load ``num_bytes`` from ``tier``; None before any sample."""
        bandwidth = self._bandwidth[tier].bytes_per_s
        return None if bandwidth is None else num_bytes / bandwidth

    def worth_loading(self, tier: str, num_blocks: int, num_bytes: int | None,
                      recompute_s: float | None) -> bool:
        """Whether to load ``num_blocks`` blocks (``num_bytes``, when known) from ``tier``
        rather than recompute them in ``recompute_s`` seconds.

        Yes before any measurement, and whenever the estimate is no slower than recomputing.
        A tier judged slower is skipped (counted) -- except once per ``reprobe_interval_s``,
        when one load is let through as a probe (see the module docstring).
        """
        if recompute_s is None or not self._skip_slow_tiers:
            return True
        if num_bytes is None:
            with self._lock:
                block_bytes = self._block_bytes
            if block_bytes is None:
                return True
            num_bytes = num_blocks * block_bytes
        estimate = self.estimate_load_s(tier, num_bytes)
        if estimate is None or estimate <= recompute_s:
            with self._lock:
                self._slow_since.pop(tier, None)
            return True
        now = self._clock()
        with self._lock:
            since = self._slow_since.setdefault(tier, now)
            if now - since >= self._reprobe_interval_s and tier not in self._probing:
                self._slow_since[tier] = now
                self._probing.add(tier)
                self._num_probes[tier] += 1
                return True
            self._num_skipped_slow[tier] += 1
            return False

    def bandwidth(self, tier: str) -> float | None:
        return self._bandwidth[tier].bytes_per_s

    def is_judged_slow(self, tier: str) -> bool:
        """Whether ``tier`` is judged slower than recomputing: a load let through is a probe,
        best one block, whose time decides the rest of the chain."""
        with self._lock:
            return tier in self._slow_since

    def stats(self) -> list[StoreReport]:
        """Each store's report, with what the hierarchy knows of it added to its notes: the
        remote writer's counts, the load bandwidth, the loads skipped as slower than
        recomputing."""
        reports = [level.store.stats() for level in self._levels.values()]
        if self.remote is not None:
            remote = self.remote.stats()
            if self._writer is not None:
                remote = replace(remote, notes=remote.notes | {
                    "remote_writes_dropped": self._writer.num_dropped,
                    "remote_writes_done": self._writer.num_written,
                    "remote_writes_over_budget": self._writer.num_over_budget})
            reports.append(remote)
        return [replace(report, notes=report.notes | self._load_notes(report.name))
                for report in reports]

    def _load_notes(self, tier: str) -> dict[str, int | float | str]:
        """What the hierarchy knows of loads from ``tier``, for its notes."""
        notes: dict[str, int | float | str] = {}
        bandwidth = self._bandwidth.get(tier)
        if bandwidth is not None and bandwidth.bytes_per_s is not None:
            notes["load_bytes_per_s"] = round(bandwidth.bytes_per_s)
        with self._lock:
            if tier in self._num_skipped_slow:
                notes["recomputed_instead"] = self._num_skipped_slow[tier]
                notes["slow_tier_probes"] = self._num_probes[tier]
        return notes
