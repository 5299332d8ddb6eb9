"""Which cached blocks have expired, found without walking the whole index.

A block's expiry is its record's (``BlockRecord.expires_at``: its last use plus its sliding TTL;
never while pinned). The sweeper asks for the expired ones every few seconds; walking every
record under the cache lock each time would cost O(blocks) per sweep. ``ExpiryQueue`` keeps a
min-heap of (expiry, record) instead, filled lazily: a record is pushed when it becomes cached
(and when it is unpinned), *not* on every hit -- a hit only moves its expiry later, and an item
that comes due early is checked against its record and pushed again at the record's current
expiry. So a hit costs nothing here, and each record has about one item on the heap.

Items outlive records that left the index (they are skipped when they come due); when such
stale items outnumber the live ones the heap is rebuilt from the index.

Not thread-safe: ``gateway.cache.placement`` calls it under the cache lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from gateway.cache.radix_index import BlockRecord

_MIN_HEAP_FOR_COMPACTION = 1024


class ExpiryQueue:
    """Records by expiry, earliest first (see the module docstring)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, BlockRecord]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, record: BlockRecord, at: float | None = None) -> None:
        """Watch ``record``: it comes due at ``at`` (default: its expiry; never, if none)."""
        due = record.expires_at() if at is None else at
        if due is not None:
            heapq.heappush(self._heap, (due, next(self._seq), record))

    def pop_expired(self, now: float,
                    is_indexed: Callable[[BlockRecord], bool]) -> list[BlockRecord]:
        """The records that have expired by ``now``, each once, earliest first.

        Items of records no longer indexed, pinned, or without a TTL are dropped (an unpin
        pushes again); items that came due before their record's current expiry (it was used
        since) are pushed again at that expiry.
        """
        expired: list[BlockRecord] = []
        seen: set[int] = set()
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, record = heapq.heappop(heap)
            if id(record) in seen or not is_indexed(record):
                continue
            due = record.expires_at()
            if due is None:
                continue
            if due > now:
                heapq.heappush(heap, (due, next(self._seq), record))
                continue
            seen.add(id(record))
            expired.append(record)
        return expired

    def compact(self, records: Iterable[BlockRecord], num_records: int) -> None:
        """Rebuild from the indexed ``records`` when stale items outnumber live ones."""
        if len(self._heap) <= max(_MIN_HEAP_FOR_COMPACTION, 2 * num_records):
            return
        self._heap = []
        for record in records:
            self.push(record)
