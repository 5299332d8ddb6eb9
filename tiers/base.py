"""The seam every KV tier plugs into, and the errors of the ``tiers`` package.

A *block store* holds block payloads (``tiers.payload.KVBlock``) by key: device memory, host
memory, files on a local disk, or a Redis shared by replicas. Stores only keep bytes; which
blocks to keep, promote or demote is decided above them (``policies`` decide victims, the prefix
cache keeps the index). A new tier is a kind: one module in ``tiers.kinds`` (its configuration
record and how its store is opened) and one line in ``tiers.kinds.registry.TIER_KINDS``
(docs/architecture.md, "Adding a tier").

Every store treats a failure to produce a block exactly as its absence: ``get`` returns None
(a miss), counts the reason, and the caller recomputes. Only bugs raise.

Errors::

    TierError                 root of every error raised on purpose by ``tiers``
     ├── CodecError           stored bytes that do not decode and verify as the expected block
     └── TierConfigError      a store cannot be set up as configured (bad path, bad URL, ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from gateway.core.admin_reports import StoreReport
from policies.base import BlockKey
from tiers.payload import KVBlock


class TierError(Exception):
    """Root of every error raised on purpose by ``tiers``."""


class CodecError(TierError):
    """Bytes that are not a valid, authentic encoding of the expected block.

    Raised for truncation, corruption, another format version, a bad MAC, a header that
    disagrees with the expected key / namespace / tokens / parent, or shapes that do not match
    the model's KV layout. ``reason`` is a short stable word for counters ("truncated",
    "magic", "version" (also every block of an older format), "mac" (header MAC), "payload_mac"
    (the MAC over header and payload: corrupted or forged bytes), "key", "namespace",
    "tokens", "parent", "shape", "codec", "size").
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TierConfigError(TierError):
    """A store cannot be set up as configured; the message says what to change."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockExpiry:
    """When a block stops being served: written into its authenticated header, so that it
    travels with the block to another replica (through Redis) and across a restart (on disk).

    Attributes:
        ttl_s: the sliding time-to-live (restarted by every hit), or None: never expires idle.
        expires_at: wall-clock (Unix) seconds at which it expired as of writing, or None: it
            did not expire then (no TTL, or pinned). Hits after the write move the expiry
            later without rewriting the header, so a restart that finds a block by its
            header alone can only expire it early, never late.
    """

    ttl_s: float | None
    expires_at: float | None

    @property
    def is_pinned(self) -> bool:
        """A TTL that does not run: the block was pinned when it was written."""
        return self.ttl_s is not None and self.expires_at is None


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockMeta:
    """What identifies one block, stored beside its payload and checked on every load.

    Attributes:
        key: the block's chained key.
        parent_key: the previous block's key (the root parent for block 0).
        namespace_digest: digest of the namespace the key was computed in.
        owner: who is charged for it (tenant id, or "shared"); restored after a restart.
        tokens: the block's token ids, little-endian uint32 bytes.
        expiry: when it stops being served (None: never). Not part of its identity: two
            metas of one block with different expiries are equal.
    """

    key: BlockKey
    parent_key: BlockKey
    namespace_digest: bytes = field(repr=False)
    owner: str
    tokens: bytes = field(repr=False)
    expiry: BlockExpiry | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4


@dataclass(slots=True)
class StoreCounters:
    """One store's live counters: mutable, owned by the store and bumped under its lock.

    They never leave the store: ``stats`` hands out a ``StoreReport`` snapshot (``report``),
    so that a caller may keep or read it while the store goes on counting.
    """

    name: str
    num_blocks: int = 0
    num_bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    deletes: int = 0
    errors: int = 0
    verification_failures: dict[str, int] = field(default_factory=dict)
    is_available: bool = True
    notes: dict[str, int | float | str] = field(default_factory=dict)

    def count_failure(self, reason: str) -> None:
        self.verification_failures[reason] = self.verification_failures.get(reason, 0) + 1

    def report(self) -> StoreReport:
        """A snapshot of the counters, maps copied. A store whose figures are not all counters
        (its size from its index, its availability, its notes) replaces those in the snapshot
        (``dataclasses.replace``)."""
        return StoreReport(
            name=self.name, num_blocks=self.num_blocks, num_bytes=self.num_bytes,
            hits=self.hits, misses=self.misses, puts=self.puts, deletes=self.deletes,
            errors=self.errors, verification_failures=dict(self.verification_failures),
            is_available=self.is_available, notes=dict(self.notes))


@runtime_checkable
class BlockStore(Protocol):
    """Keeps block payloads by key; knows nothing of policies or the index.

    Contract:
      * ``put`` stores (or queues) the block. Blocks are read-only once computed: the caller
        never writes into a block's tensors after handing it over, so a store may keep them as
        they are (the device tier does) or copy them. A store that cannot take a block (disk
        full, Redis down) drops it and counts why.
      * ``get`` returns the block only if it is present and verifies against ``meta``
        (tokens, parent, namespace, and a MAC over header and payload where bytes leave the
        process); otherwise None,
        counting the reason. A block that failed verification is deleted.
      * ``get_many``/``put_many`` exist so that remote stores can batch (one round trip for a
        chain); the defaults in ``BatchDefaults`` loop over the single calls.
    """

    name: str

    def put(self, meta: BlockMeta, block: KVBlock) -> None: ...

    def get(self, meta: BlockMeta) -> KVBlock | None: ...

    def delete(self, key: BlockKey) -> None: ...

    def contains(self, key: BlockKey) -> bool: ...

    def get_many(self, metas: Sequence[BlockMeta]) -> list[KVBlock | None]: ...

    def put_many(self, items: Sequence[tuple[BlockMeta, KVBlock]]) -> None: ...

    def stats(self) -> StoreReport: ...

    def close(self) -> None: ...


class PageReader(BlockStore, Protocol):
    """A store whose ``get`` takes ``into``: it reads a block straight into a page it is given
    (copied or decoded into the pool's memory: no buffer of its own) and returns that page as
    the block (the host, quantized host and disk tiers). The hierarchy tells one by that
    parameter (``tiers.hierarchy.takes_pages``)."""

    def get(self, meta: BlockMeta, *, into: KVBlock | None = None) -> KVBlock | None: ...


class ChainPageReader(PageReader, Protocol):
    """A ``PageReader`` whose ``get_many`` takes ``into`` too: it reads a chain into its pages in
    one go (one lock, one fence: the host tier), so the hierarchy hands it the whole chain
    instead of block by block."""

    def get_many(self, metas: Sequence[BlockMeta], *,
                 into: Sequence[KVBlock] = ()) -> list[KVBlock | None]: ...


class BatchDefaults:
    """Mixin: batch calls that loop over the single-item ones (override to do better)."""

    def get_many(self: BlockStore, metas: Sequence[BlockMeta]) -> list[KVBlock | None]:
        return [self.get(meta) for meta in metas]

    def put_many(self: BlockStore, items: Sequence[tuple[BlockMeta, KVBlock]]) -> None:
        for meta, block in items:
            self.put(meta, block)


@runtime_checkable
class RemoteStore(BlockStore, Protocol):
    """A store shared by replicas (Redis): blocks are addressed by their full identity, since
    this process may never have seen them, and a tenant's blocks can be removed wholesale."""

    def delete_meta(self, meta: BlockMeta) -> None: ...

    def delete_metas(self, metas: Sequence[BlockMeta], *,
                     min_idle_s: float | None = None) -> int:
        """Delete these blocks (only those idle at least ``min_idle_s``); how many went."""
        ...

    def remove_where(self, *, namespace_digest: bytes | None = None,
                     key: BlockKey | None = None, min_idle_s: float | None = None) -> int:
        """Remove every block of the deployment matching all given selectors."""
        ...

    def fetch_chain(
        self, metas: Sequence[BlockMeta], *, into: Sequence[KVBlock] = ()
    ) -> list[tuple[KVBlock, BlockExpiry | None] | None]:
        """``get_many`` with each block's expiry from its verified header; block ``i`` is
        decoded into ``into[i]`` where there is one, and is then that block
        (``PayloadFormat.unpack``)."""
        ...

    def refresh_expiry(self, metas: Sequence[BlockMeta]) -> None:
        """Give these blocks' copies the expiry their metas say (pin, unpin)."""
        ...
