"""Conversation tails: the K/V of the tokens after a conversation's last full block.

Why: the cache stores whole blocks, so each chat turn used to recompute the tokens after the
previous turn's last full block (on average half a block, here ~32 tokens, plus the answer's
end) before the new message; the next turn of a conversation is the one request that always
continues exactly there. When the forward is invariant and decoding writes the K/V a prefill
writes (``gateway.engine.parity.probe``), those positions' K/V are exactly what a cold prefill of
the same tokens computes, so the engine keeps them, in its own memory and for a bounded number of
bytes, and the next turn starts after them.

Identity: a tail continues one cached block, the ``BlockRecord`` of the conversation's last full
block in the tenant's namespace (its key is keyed by the namespace, so no tenant ever reaches
another's tail). A tail is used only while that very record is in the index: a block evicted or
expired takes its tails with it, even if the same block is stored again later.

Sessions: a tail belongs to the session whose request kept it while no request of another
session (or of none) has continued it, as blocks do (``gateway.cache.sessions``); a session's
reset or expiry drops its tails (``drop_session``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import numpy as np

from gateway.cache.radix_index import BlockRecord
from gateway.cache.sessions import COMMON
from gateway.core.fingerprint import Namespace
from policies.base import BlockKey
from tiers.payload import KVBlock

_TailId = tuple[Namespace, BlockKey, bytes]

TAIL_TIER = "device"
"""What ``cached_tokens_by_tier`` calls a tail's tokens: they are held where the model runs."""


@dataclass(frozen=True, slots=True)
class _Tail:
    parent: BlockRecord
    tokens: np.ndarray
    kv: KVBlock
    nbytes: int
    session: str = COMMON  # whose tail it is (``gateway.cache.sessions``)


@dataclass(frozen=True, slots=True)
class TailCounters:
    """What the tail cache did since start.

    Attributes:
        num_hits: requests that started after a kept tail.
        num_tokens_served: tokens those tails spared from recomputation.
        num_kept: tails kept.
        num_dropped: tails dropped (for room, or because their block left the cache).
        num_bytes: bytes the kept tails hold now.
    """

    num_hits: int = 0
    num_tokens_served: int = 0
    num_kept: int = 0
    num_dropped: int = 0
    num_bytes: int = 0


class TailCache:
    """Keeps conversation tails in least-recently-used order within ``capacity_bytes``.

    Args:
        capacity_bytes: the most bytes kept tails hold together (0: keep none).
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = capacity_bytes
        self._tails: OrderedDict[_TailId, _Tail] = OrderedDict()
        self._by_parent: dict[tuple[Namespace, BlockKey], set[_TailId]] = {}
        self._num_bytes = 0
        self._num_hits = self._num_tokens_served = self._num_kept = self._num_dropped = 0
        self._lock = threading.Lock()  # the loop writes, Stats reads

    @property
    def counters(self) -> TailCounters:
        with self._lock:
            return TailCounters(num_hits=self._num_hits,
                                num_tokens_served=self._num_tokens_served,
                                num_kept=self._num_kept, num_dropped=self._num_dropped,
                                num_bytes=self._num_bytes)

    def keep(self, namespace: Namespace, parent: BlockRecord, tokens: np.ndarray,
             kv: KVBlock, session_id: str | None = None) -> None:
        """Keep ``kv``, the K/V of ``tokens`` right after the block ``parent``, for a request of
        ``session_id`` (None: of no session).

        ``kv`` must be the caller's own copy (it is shared with later requests, read-only).
        """
        if len(tokens) == 0 or len(tokens) != kv.num_tokens:
            raise ValueError(f"a tail of {len(tokens)} tokens with K/V of {kv.num_tokens}")
        nbytes = kv.nbytes
        if nbytes > self._capacity:
            return
        tail_id = (namespace, parent.key, np.ascontiguousarray(tokens, np.uint32).tobytes())
        with self._lock:
            self._drop(tail_id)
            while self._num_bytes + nbytes > self._capacity:
                self._drop(next(iter(self._tails)))
            self._tails[tail_id] = _Tail(parent=parent, tokens=np.array(tokens, np.uint32),
                                         kv=kv, nbytes=nbytes, session=session_id or COMMON)
            self._by_parent.setdefault(tail_id[:2], set()).add(tail_id)
            self._num_bytes += nbytes
            self._num_kept += 1

    def find(self, namespace: Namespace, parent: BlockRecord, following: np.ndarray,
             max_tokens: int, session_id: str | None = None) -> KVBlock | None:
        """The longest kept tail after ``parent`` whose tokens begin ``following``, at most
        ``max_tokens`` long, for a request of ``session_id``; None if there is none."""
        best: _Tail | None = None
        with self._lock:
            for tail_id in list(self._by_parent.get((namespace, parent.key), ())):
                tail = self._tails[tail_id]
                if tail.parent is not parent:
                    self._drop(tail_id)  # its block was evicted (and maybe stored again)
                    continue
                n = len(tail.tokens)
                if (n <= max_tokens and n <= len(following)
                        and np.array_equal(tail.tokens, following[:n])
                        and (best is None or n > len(best.tokens))):
                    best = tail
            if best is None:
                return None
            best_id = (namespace, parent.key, best.tokens.tobytes())
            self._tails.move_to_end(best_id)
            if best.session != (session_id or COMMON):  # continued by another: nobody's own
                self._tails[best_id] = replace(best, session=COMMON)
            self._num_hits += 1
            self._num_tokens_served += len(best.tokens)
            return best.kv

    def session_tail(self, owner: str, session_id: str) -> tuple[int, int]:
        """Tokens and bytes of the tails ``owner``'s session ``session_id`` kept and alone
        continued."""
        with self._lock:
            mine = [t for (ns, _, _), t in self._tails.items()
                    if t.session == session_id and ns.scope.owner == owner]
            return sum(len(t.tokens) for t in mine), sum(t.nbytes for t in mine)

    def drop_session(self, owner: str, session_id: str) -> int:
        """Drop the tails of ``owner``'s session ``session_id``; the bytes they held."""
        with self._lock:
            mine = [tail_id for tail_id, t in self._tails.items()
                    if t.session == session_id and tail_id[0].scope.owner == owner]
            before = self._num_bytes
            for tail_id in mine:
                self._drop(tail_id)
            return before - self._num_bytes

    def _drop(self, tail_id: _TailId) -> None:
        tail = self._tails.pop(tail_id, None)
        if tail is None:
            return
        self._num_bytes -= tail.nbytes
        siblings = self._by_parent[tail_id[:2]]
        siblings.discard(tail_id)
        if not siblings:
            del self._by_parent[tail_id[:2]]
        self._num_dropped += 1

