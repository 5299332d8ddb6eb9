"""How the stores know a cached block: its keys, its ``BlockMeta``, and its expiry in wall time.

A record in the index is this process's; what leaves the process with its bytes (a disk header,
a Redis entry) must say which block it is and when it expires without the index: its key, its
parent's key (or its namespace's root), its namespace, its tokens, and its expiry as a Unix
time, since the cache's own clock (monotonic) means nothing to another process or after a
restart. ``BlockIdentity`` makes those from a record, and turns a wall-clock expiry read back
into the cache's clock. It keeps no state but the memoised fingerprinters.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.cache.radix_index import BlockRecord
from gateway.core.fingerprint import BlockFingerprinter, Namespace
from tiers.base import BlockExpiry, BlockMeta


class BlockIdentity:
    """A record's identity and expiry as a store files them.

    Args:
        block_tokens: tokens per block.
        key_bytes: block key size; only tests shrink it, to force collisions.
        clock: the cache's time source (seconds).
        wall_clock: Unix time (seconds): a block's expiry leaves the process in wall time.
    """

    def __init__(self, *, block_tokens: int, key_bytes: int, clock: Callable[[], float],
                 wall_clock: Callable[[], float]) -> None:
        self._block_tokens = block_tokens
        self._key_bytes = key_bytes
        self._clock = clock
        self._wall_clock = wall_clock
        self._fingerprinters: dict[bytes, BlockFingerprinter] = {}

    def now(self) -> float:
        """The cache's clock."""
        return self._clock()

    def to_monotonic(self, unix_s: float) -> float:
        """The cache-clock time of a wall-clock (Unix) time."""
        return self._clock() + (unix_s - self._wall_clock())

    def fingerprinter(self, namespace: Namespace) -> BlockFingerprinter:
        """The (memoised) block keys of ``namespace``; no lock: ``setdefault`` keeps one."""
        fp = self._fingerprinters.get(namespace.digest)
        if fp is None:
            fp = self._fingerprinters.setdefault(namespace.digest, BlockFingerprinter(
                namespace, self._block_tokens, key_bytes=self._key_bytes))
        return fp

    def expiry(self, record: BlockRecord) -> BlockExpiry | None:
        """``record``'s expiry as it leaves the process (in a header): its TTL, and when it
        expires in wall time (None while pinned); None if it has no TTL."""
        if record.ttl_s is None:
            return None
        due = record.expires_at()
        if due is None:
            return BlockExpiry(ttl_s=record.ttl_s, expires_at=None)
        unix_due = self._wall_clock() + (due - self._clock())
        return BlockExpiry(ttl_s=record.ttl_s, expires_at=unix_due)

    def new_expiry(self, ttl_s: float | None) -> BlockExpiry | None:
        """The expiry of a block stored now with ``ttl_s`` that no record here tracks (a copy
        written straight to the remote tier)."""
        if ttl_s is None:
            return None
        return BlockExpiry(ttl_s=ttl_s, expires_at=self._wall_clock() + ttl_s)

    def meta(self, record: BlockRecord) -> BlockMeta:
        """The identity a store files ``record`` under (key, parent, namespace, tokens)."""
        parent = record.parent
        namespace = record.namespace
        return BlockMeta(
            key=record.key,
            parent_key=parent.key if parent is not None else self.fingerprinter(
                namespace).root_parent,
            namespace_digest=namespace.digest,
            owner=namespace.scope.owner,
            tokens=record.tokens,
            expiry=self.expiry(record),
        )
