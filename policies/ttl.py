"""Sliding time-to-live: a block idle for longer than its TTL is offered for eviction first.

Hosted prompt-caching APIs promise that a cached prefix lives for a few minutes after its last
use; this policy tracks that promise per block. It only *ranks*: an expired block is still
served until its owner removes it (``policies.stack.TierPolicy.sweep_expired``, or an eviction
that takes expired blocks first), because only the owner knows whether a block may go (it may
be pinned, in use, or the parent of a block that must stay).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from policies.base import BlockKey, PolicyEntry, Shortfall

# The heap is rebuilt when it holds more than this many stale items per live one (plus a
# constant, so that small heaps are not rebuilt on every access).
_MAX_STALE_PER_LIVE = 1
_MIN_HEAP_FOR_COMPACTION = 64


class _Expiry(NamedTuple):
    """When one block expires, and why: the heap item and the per-key record at once.

    NOTE: one immutable tuple serves as both, so a block costs a single small object; an item
    on the heap is current exactly when it *is* the key's record (identity, not equality), which
    is how stale items left by accesses and removals are recognised (lazy deletion). Heap order
    compares ``(expires_at, seq)`` only: ``seq`` is unique, so later fields are never compared.
    """

    expires_at: float  # math.inf when the block never expires
    seq: int  # order in which expiries were set: the tie-breaker
    entry: PolicyEntry  # the caller's own object: its key, tenant and ttl_s cost nothing more


class TTLPolicy:
    """Offers blocks whose sliding TTL has run out, earliest expiry first.

    A block with ``ttl_s`` expires ``ttl_s`` seconds after its last insert or access; at that
    instant (``now >= expires_at``) it counts as expired. ``ttl_s=None`` never expires. Ties
    between equal expiry times go to the block whose expiry was set first.

    Args:
        clock: returns the current time in seconds; injected so tests can use a fake clock
            instead of sleeping (as cachetools' ``TTLCache(timer=...)`` does).
    """

    __slots__ = ("_clock", "_key_to_expiry", "_heap", "_num_expiring", "_seq")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._key_to_expiry: dict[BlockKey, _Expiry] = {}
        # Min-heap of expiring blocks' records, possibly with stale items (lazy deletion).
        self._heap: list[_Expiry] = []
        self._num_expiring = 0  # live records with a finite TTL, i.e. live items on the heap
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._key_to_expiry)

    def is_expired(self, key: BlockKey) -> bool:
        """Whether a tracked block's TTL has run out at the current time.

        Raises:
            KeyError: the key is not tracked.
        """
        return self._key_to_expiry[key].expires_at <= self._clock()

    def expires_at(self, key: BlockKey) -> float | None:
        """The clock time at which a tracked block expires, or None if it never does.

        Raises:
            KeyError: the key is not tracked.
        """
        expiry = self._key_to_expiry[key]
        return None if expiry.entry.ttl_s is None else expiry.expires_at

    def on_insert(self, entry: PolicyEntry) -> None:
        """Start a block's TTL now.

        Raises:
            ValueError: the key is already tracked, or ``ttl_s`` is negative or NaN.
        """
        key = entry.key
        if key in self._key_to_expiry:
            raise ValueError(f"block {key.hex()} is already tracked by this TTL policy")
        ttl_s = entry.ttl_s
        if ttl_s is not None and not ttl_s >= 0:
            raise ValueError(f"block {key.hex()} has ttl_s={ttl_s!r}; expected >= 0 or None")
        if ttl_s is not None:
            self._num_expiring += 1
        self._set_expiry(entry)

    def on_access(self, key: BlockKey) -> None:
        """Restart a tracked block's TTL (it is sliding).

        Raises:
            KeyError: the key is not tracked.
        """
        entry = self._key_to_expiry[key].entry
        if entry.ttl_s is not None:
            self._set_expiry(entry)
            self._compact_if_stale()

    def on_remove(self, key: BlockKey) -> None:
        """Forget a block; its heap item, if any, becomes stale.

        Raises:
            KeyError: the key is not tracked.
        """
        expiry = self._key_to_expiry.pop(key)
        if expiry.entry.ttl_s is not None:
            self._num_expiring -= 1
            self._compact_if_stale()

    def candidates(self, tenant: str | None = None) -> Iterator[BlockKey]:
        """Yield the keys expired at the current time, earliest expiry first.

        The heap is walked in order without popping (a best-first search over heap indices),
        so an expired block that its owner cannot evict yet keeps its place for next time, and
        the walk costs O(k log k) for k expired items rather than O(tracked).
        """
        now = self._clock()
        heap = self._heap
        key_to_expiry = self._key_to_expiry
        frontier: list[tuple[float, int, int]] = []  # (expires_at, seq, heap index)
        if heap:
            frontier.append((heap[0].expires_at, heap[0].seq, 0))
        while frontier:
            expires_at, _, index = heapq.heappop(frontier)
            if expires_at > now:
                return  # the frontier pops in order: nothing later has expired either
            item = heap[index]
            entry = item.entry
            is_current = key_to_expiry.get(entry.key) is item
            if is_current and (tenant is None or entry.tenant == tenant):
                yield entry.key
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child].expires_at, heap[child].seq, child))

    def shortfall(self, entry: PolicyEntry) -> Shortfall | None:
        """Always None: TTL ranks expired victims, it does not limit what fits."""
        return None

    def _set_expiry(self, entry: PolicyEntry) -> None:
        ttl_s = entry.ttl_s
        expires_at = math.inf if ttl_s is None else self._clock() + ttl_s
        expiry = _Expiry(expires_at, next(self._seq), entry)
        self._key_to_expiry[entry.key] = expiry
        if ttl_s is not None:
            heapq.heappush(self._heap, expiry)

    def _compact_if_stale(self) -> None:
        """Rebuild the heap from live records once stale items outnumber live ones.

        Without this, a hot block accessed a million times would leave a million stale items.
        The rebuild is O(live) and happens after O(live) stale items accumulate: amortised O(1).
        """
        num_stale = len(self._heap) - self._num_expiring
        if len(self._heap) < _MIN_HEAP_FOR_COMPACTION:
            return
        if num_stale <= _MAX_STALE_PER_LIVE * self._num_expiring:
            return
        self._heap = [e for e in self._key_to_expiry.values() if e.entry.ttl_s is not None]
        heapq.heapify(self._heap)
