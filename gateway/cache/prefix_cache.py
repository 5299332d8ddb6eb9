"""The prefix cache: the radix index, each tier's policy and the reference counts, kept in step.

This is the one object the request path talks to: which blocks of a prompt are cached and
where, which of them a running request is reading (so nothing evicts them), which new blocks to
admit into a tier and what to evict for them, and -- when a ``TierHierarchy`` carries the bytes
-- loading a matched prefix (promoting it to the fastest tier), demoting what a tier evicts to
the tier below, and extending a local match with blocks another replica left in Redis. This
module decides; ``tiers`` carries the bytes.

Rules it keeps (the invariants the property tests check):
  * a block is in the index exactly while at least one tier holds it;
  * a block with references (``refcount > 0``) or pinned is never evicted;
  * a block leaves a tier only when none of its children is held in that tier, and leaves the
    last tier only when it has no children at all: a block is only usable with all its
    ancestors. (If a demotion fails, a block with children stays in the index as a *ghost*,
    held by no tier; lookups stop at it and it leaves with its last descendant.)
  * a load that does not verify is a miss: the copy is dropped and the prefix is cut there;
  * an expired block (sliding TTL) is never returned by a lookup, and sweeping removes it;
  * all of it under one lock, so request threads, the sweeper and admin calls can mix.

Every acquire is released by a context manager: ``with cache.acquire(ns, tokens) as lease:``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

from gateway.cache.radix_index import BlockRecord, BlockSpec, RadixIndex
from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import BlockFingerprinter, Namespace, Scope
from gateway.core.tokens import BYTES_PER_TOKEN, TokenIds, token_view
from policies.base import BlockKey, InsertRefused, PolicyEntry
from policies.stack import EvictionResult, TierPolicy
from tiers.base import BlockMeta, StoreStats
from tiers.hierarchy import REMOTE, TierHierarchy
from tiers.payload import KVBlock


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSlot:
    """One tier as the prefix cache sees it: a name, the policy that governs it, and whether
    every inserted block is also written to it at once (write-through: the disk tier, so that
    a restart finds what was hot, not only what had been demoted)."""

    name: str
    policy: TierPolicy
    write_through: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixMatch:
    """How much of a prompt is cached (in its own namespace), and where.

    Attributes:
        num_blocks: full blocks of the prompt that are cached, from the start.
        num_tokens: the tokens they cover.
        keys: their keys, in order.
        tiers: for each of them, the fastest tier that holds it.
        num_prompt_blocks: full blocks in the whole prompt.
        diverges_at_block: first block that is not cached (== num_blocks), or None if every
            full block is.
        num_token_mismatches: 1 if a key matched but its tokens did not (a collision, counted
            and treated as a miss).
    """

    num_blocks: int
    num_tokens: int
    keys: tuple[BlockKey, ...]
    tiers: tuple[str, ...]
    num_prompt_blocks: int
    diverges_at_block: int | None
    num_token_mismatches: int = 0

    def tokens_in_tier(self, tier: str, block_tokens: int) -> int:
        return sum(block_tokens for t in self.tiers if t == tier)


@dataclass(frozen=True, slots=True, kw_only=True)
class InsertResult:
    """What an insert stored in a tier, and what it could not."""

    num_new_blocks: int
    num_existing_blocks: int
    num_refused_blocks: int
    num_evicted_blocks: int
    refusal: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixInfo:
    """One cached prompt (a leaf and its ancestors), for admin listings."""

    owner: str
    key: BlockKey
    num_blocks: int
    num_tokens: int
    num_bytes: int
    tiers: tuple[str, ...]
    idle_s: float
    num_hits: int
    is_pinned: bool
    first_block_tokens: bytes


@dataclass(slots=True)
class TierCounters:
    """Per-tier counters for ``stats``."""

    hits: int = 0
    inserts: int = 0
    refused: int = 0
    promotions: int = 0
    demotions: int = 0
    load_failures: int = 0
    recomputed_instead: int = 0
    evictions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    """One tier's figures as the prefix cache sees them (blocks, bytes, decisions)."""

    name: str
    num_blocks: int
    used_bytes: int
    budget_bytes: int
    hits: int
    inserts: int
    refused: int
    promotions: int
    demotions: int
    load_failures: int
    recomputed_instead: int
    evictions: dict[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheStats:
    """Everything ``stats`` reports: the index, each tier's policy view, each store's counters.

    Plain data (dataclasses of ints, floats, strings and dicts), for the admin API and metrics.
    """

    num_blocks: int
    num_namespaces: int
    num_token_mismatches: int
    num_remote_hits: int
    tiers: tuple[TierStats, ...]
    stores: tuple[StoreStats, ...] = ()


class Lease:
    """A running request's hold on the cached prefix of its prompt.

    Holds one reference on every matched block until ``release`` (done by the context manager
    of ``PrefixCache.acquire``). Remembers the prompt's block keys so that inserting the rest of
    the prompt later hashes nothing twice.
    """

    __slots__ = ("namespace", "tokens", "keys", "match", "_records", "_is_released")

    def __init__(
        self,
        *,
        namespace: Namespace,
        tokens: TokenIds,
        keys: list[BlockKey],
        match: PrefixMatch,
        records: list[BlockRecord],
    ) -> None:
        self.namespace = namespace
        self.tokens = tokens
        self.keys = keys
        self.match = match
        self._records = records
        self._is_released = False

    @property
    def is_released(self) -> bool:
        return self._is_released


class PrefixCache:
    """Radix index + tier policies + reference counts behind one lock, and the bytes' moves.

    Args:
        tiers: the local tiers, fastest first, each with its policy.
        block_tokens: tokens per block.
        hierarchy: the stores carrying the bytes, with the same tier names in the same order;
            None keeps metadata only (a block that leaves a tier is simply dropped from it).
        remote_write: write every newly inserted chain through to the remote (Redis) store.
        promote_on_hit: copy blocks loaded from a slower tier into the fastest one.
        clock: time source (seconds); injected so that TTL tests need no sleeping.
        key_bytes: block key size; only tests shrink it, to force collisions.
    """

    def __init__(
        self,
        *,
        tiers: Sequence[TierSlot],
        block_tokens: int,
        hierarchy: TierHierarchy | None = None,
        remote_write: bool = False,
        promote_on_hit: bool = True,
        clock: Callable[[], float] = time.monotonic,
        key_bytes: int = 16,
    ) -> None:
        if not tiers:
            raise ValueError("a prefix cache needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if hierarchy is not None and tuple(names) != hierarchy.names:
            raise ValueError(f"tiers {names} do not match the hierarchy's {hierarchy.names}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self._tiers = list(tiers)
        self._bit_of = {t.name: 1 << i for i, t in enumerate(tiers)}
        self._counters = {t.name: TierCounters() for t in tiers}
        self.block_tokens = block_tokens
        self._block_bytes = block_tokens * BYTES_PER_TOKEN
        self._hierarchy = hierarchy
        self._remote_write = remote_write and hierarchy is not None and hierarchy.remote is not None
        self._promote_on_hit = promote_on_hit
        self._clock = clock
        self._key_bytes = key_bytes
        self._index = RadixIndex()
        self._lock = threading.RLock()
        self._fingerprinters: dict[bytes, BlockFingerprinter] = {}
        self._num_token_mismatches = 0
        self._num_remote_hits = 0

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self._tiers)

    # ---- reading ------------------------------------------------------------------------

    def fingerprinter(self, namespace: Namespace) -> BlockFingerprinter:
        with self._lock:
            fp = self._fingerprinters.get(namespace.digest)
            if fp is None:
                fp = BlockFingerprinter(namespace, self.block_tokens, key_bytes=self._key_bytes)
                self._fingerprinters[namespace.digest] = fp
            return fp

    def lookup(self, namespace: Namespace, tokens: TokenIds) -> PrefixMatch:
        """How much of ``tokens`` is cached locally in ``namespace``; changes nothing."""
        keys = self.fingerprinter(namespace).block_keys(tokens)
        with self._lock:
            match, _, _ = self._match(namespace, tokens, keys)
            return match

    def _match(
        self, namespace: Namespace, tokens: TokenIds, keys: list[BlockKey]
    ) -> tuple[PrefixMatch, list[BlockRecord], bool]:
        """Longest live cached prefix; the flag says whether an expired block cut it short."""
        result = self._index.match(
            namespace, keys, token_data=token_view(tokens), block_bytes=self._block_bytes
        )
        now = self._clock()
        records: list[BlockRecord] = []
        met_expired = False
        for record in result.records:
            if record.tier_mask == 0:
                break  # a ghost: its bytes are gone, only its descendants keep it in the trie
            if record.is_expired(now):
                met_expired = True
                break
            records.append(record)
        self._num_token_mismatches += result.num_token_mismatches
        match = self._make_match(
            records, tuple(self._fastest_tier(r) for r in records), len(keys),
            result.num_token_mismatches,
        )
        return match, records, met_expired

    def _make_match(
        self,
        records: Sequence[BlockRecord],
        tiers: tuple[str, ...],
        num_prompt_blocks: int,
        num_token_mismatches: int = 0,
    ) -> PrefixMatch:
        num_blocks = len(records)
        return PrefixMatch(
            num_blocks=num_blocks,
            num_tokens=num_blocks * self.block_tokens,
            keys=tuple(r.key for r in records),
            tiers=tiers,
            num_prompt_blocks=num_prompt_blocks,
            diverges_at_block=None if num_blocks == num_prompt_blocks else num_blocks,
            num_token_mismatches=num_token_mismatches,
        )

    def _fastest_tier(self, record: BlockRecord) -> str:
        for tier in self._tiers:
            if record.tier_mask & self._bit_of[tier.name]:
                return tier.name
        raise IndexInvariantError("a block in the index is held by no tier")

    def _meta(self, record: BlockRecord) -> BlockMeta:
        parent = record.parent
        namespace = record.namespace
        return BlockMeta(
            key=record.key,
            parent_key=parent.key if parent is not None else self.fingerprinter(
                namespace).root_parent,
            namespace_digest=namespace.digest,
            owner=namespace.scope.owner,
            tokens=record.tokens,
        )

    # ---- leases -------------------------------------------------------------------------

    @contextmanager
    def acquire(self, namespace: Namespace, tokens: TokenIds) -> Iterator[Lease]:
        """Match ``tokens`` and hold their cached prefix until the ``with`` block ends.

        A hit counts as an access in every tier holding the block (LRU recency, TTL restart).
        Expired blocks met on the way are swept.
        """
        keys = self.fingerprinter(namespace).block_keys(tokens)
        with self._lock:
            match, records, met_expired = self._match(namespace, tokens, keys)
            now = self._clock()
            # Children first, so that recency orders ancestors after their descendants.
            for record in reversed(records):
                record.refcount += 1
                record.num_hits += 1
                self._touch(record, now)
            if records:
                self._counters[match.tiers[-1]].hits += 1
            if met_expired:
                self._sweep_expired_locked()
        lease = Lease(namespace=namespace, tokens=tokens, keys=keys, match=match, records=records)
        try:
            yield lease
        finally:
            self._release(lease)

    def _touch(self, record: BlockRecord, now: float) -> None:
        """An access: restart the block's TTL and tell every tier holding it."""
        record.last_access = now
        for slot in self._tiers:
            if record.tier_mask & self._bit_of[slot.name]:
                slot.policy.access(record.key)

    def _release(self, lease: Lease) -> None:
        with self._lock:
            if lease._is_released:
                raise IndexInvariantError("lease released twice")
            lease._is_released = True
            for record in lease._records:
                if record.refcount <= 0:
                    raise IndexInvariantError("refcount would go below zero")
                record.refcount -= 1
            self._drop_unheld(reversed(lease._records))

    # ---- writing ------------------------------------------------------------------------

    def insert(
        self,
        lease: Lease,
        *,
        tier: str,
        blocks: Sequence[KVBlock] | None = None,
        block_bytes: int | None = None,
        ttl_s: float | None = None,
        num_blocks: int | None = None,
    ) -> InsertResult:
        """Store the lease's not-yet-cached full blocks in ``tier``.

        Args:
            lease: the request's lease (its matched prefix is the parent of what is inserted).
            tier: where the blocks go.
            blocks: the payloads of the blocks after the matched prefix, in order (required when
                a hierarchy carries bytes); their sizes are what the policies charge.
            block_bytes: the size of each new block, when no payloads are given.
            ttl_s: sliding TTL of the new blocks; None for no expiry.
            num_blocks: insert only the prompt's first ``num_blocks`` full blocks.

        Blocks that do not fit (quota, budget, or everything else pinned) are refused, not
        forced: they and everything after them are left out, and the result says why.
        """
        if lease.is_released:
            raise IndexInvariantError("insert through a released lease")
        slot = self._slot(tier)
        start = lease.match.num_blocks
        end = len(lease.keys) if num_blocks is None else min(num_blocks, len(lease.keys))
        if blocks is not None:
            end = min(end, start + len(blocks))
        elif self._hierarchy is not None:
            raise ValueError("blocks are required when the cache carries bytes")
        elif block_bytes is None:
            raise ValueError("give either blocks or block_bytes")
        if end <= start:
            return InsertResult(
                num_new_blocks=0, num_existing_blocks=0, num_refused_blocks=0,
                num_evicted_blocks=0,
            )
        fp = self.fingerprinter(lease.namespace)
        specs = [
            BlockSpec(
                key=lease.keys[i],
                tokens=fp.block_token_bytes(lease.tokens, i),
                num_bytes=blocks[i - start].nbytes if blocks is not None else int(block_bytes or 0),
            )
            for i in range(start, end)
        ]
        with self._lock:
            self._forget_failed_writes()
            parent = lease._records[-1] if lease._records else None
            if parent is not None and parent.key not in self._index:
                raise IndexInvariantError("a leased block left the index")
            now = self._clock()
            chain = self._index.insert(lease.namespace, parent, specs, now=now, ttl_s=ttl_s)
            # Hold the chain while admitting it, so that making room never evicts a block of it.
            for record in chain:
                record.refcount += 1
            try:
                result, stored = self._admit_chain(chain, len(specs), slot, blocks)
            finally:
                for record in chain:
                    record.refcount -= 1
                self._drop_unheld(reversed(chain))
        if self._remote_write and stored and self._hierarchy is not None:
            self._hierarchy.write_remote(stored)
        return result

    def _forget_failed_writes(self) -> None:
        """Drop the tier copies whose queued writes failed (disk full, I/O error)."""
        if self._hierarchy is None:
            return
        for tier, keys in self._hierarchy.drain_failed().items():
            bit = self._bit_of[tier]
            slot = self._slot(tier)
            for key in keys:
                record = self._index.get(key)
                if record is not None and record.tier_mask & bit:
                    slot.policy.discard(key)
                    record.tier_mask &= ~bit
                    self._drop_unheld([record])

    def _admit_chain(
        self,
        chain: list[BlockRecord],
        num_wanted: int,
        slot: TierSlot,
        blocks: Sequence[KVBlock] | None,
    ) -> tuple[InsertResult, list[tuple[BlockMeta, KVBlock]]]:
        counters = self._counters[slot.name]
        bit = self._bit_of[slot.name]
        num_new = num_existing = num_evicted = 0
        refusal: str | None = None
        admitted = 0
        stored: list[tuple[BlockMeta, KVBlock]] = []
        now = self._clock()
        for i, record in enumerate(chain):
            if record.tier_mask:
                # Computed again by this request: it is live, whatever its TTL said.
                self._touch(record, now)
            if record.tier_mask & bit:
                num_existing += 1
                admitted += 1
                continue
            try:
                num_evicted += self._admit(record, slot)
            except InsertRefused as exc:
                refusal = str(exc)
                break
            if blocks is not None and self._hierarchy is not None:
                meta = self._meta(record)
                self._hierarchy.write(slot.name, meta, blocks[i])
                stored.append((meta, blocks[i]))
                self._write_through(record, meta, blocks[i], slot)
            record.tier_mask |= bit
            num_new += 1
            admitted += 1
        counters.inserts += num_new
        num_refused = num_wanted - admitted
        counters.refused += num_refused
        result = InsertResult(
            num_new_blocks=num_new,
            num_existing_blocks=num_existing,
            num_refused_blocks=num_refused,
            num_evicted_blocks=num_evicted,
            refusal=refusal if num_refused else None,
        )
        return result, stored

    def _write_through(
        self, record: BlockRecord, meta: BlockMeta, block: KVBlock, inserted_into: TierSlot
    ) -> None:
        """Also store a new block in every write-through tier (if its policy admits it)."""
        assert self._hierarchy is not None
        for slot in self._tiers:
            bit = self._bit_of[slot.name]
            if not slot.write_through or slot is inserted_into or record.tier_mask & bit:
                continue
            try:
                self._admit(record, slot)
            except InsertRefused:
                continue
            self._hierarchy.write(slot.name, meta, block)
            record.tier_mask |= bit

    def _admit(self, record: BlockRecord, slot: TierSlot) -> int:
        """Make room for ``record`` in ``slot``'s policy and record it there; victims count."""
        entry = PolicyEntry(
            key=record.key,
            tenant=record.namespace.scope.owner,
            num_bytes=record.num_bytes,
            ttl_s=record.ttl_s,
        )
        result = slot.policy.admit(
            entry,
            can_evict=partial(self._can_evict, slot=slot),
            remove=partial(self._remove_from_tier, slot=slot, reason="capacity"),
        )
        return len(result.victims)

    def _drop_unheld(self, records: Iterable[BlockRecord]) -> None:
        """Remove records held by no tier and used by nobody, leaves first, then any ghost
        ancestors they leave childless."""
        for record in records:
            node: BlockRecord | None = record
            while (
                node is not None
                and node.tier_mask == 0
                and node.refcount == 0
                and node.key in self._index
                and not self._index.has_children(node)
            ):
                parent = node.parent
                self._index.remove(node)
                node = parent

    # ---- eviction -----------------------------------------------------------------------

    def _can_evict(self, key: BlockKey, slot: TierSlot) -> bool:
        record = self._index.get(key)
        if record is None or record.refcount or record.is_pinned:
            return False
        bit = self._bit_of[slot.name]
        if self._index.has_child_in(record, bit):
            return False
        if record.tier_mask == bit and self._index.has_children(record):
            # Its last copy: only if it can move down, or a child would lose its parent.
            return self._hierarchy is not None and self._hierarchy.below(slot.name) is not None
        return True

    def _remove_from_tier(self, key: BlockKey, slot: TierSlot, reason: str) -> None:
        """A policy chose ``key`` as a victim in ``slot``: demote its bytes, then drop it."""
        record = self._index.get(key)
        if record is None:
            raise IndexInvariantError("evicting a block that is not in the index")
        bit = self._bit_of[slot.name]
        counters = self._counters[slot.name]
        if self._hierarchy is not None:
            self._demote(record, slot)
            self._hierarchy.delete(slot.name, key)
        record.tier_mask &= ~bit
        counters.evictions[reason] = counters.evictions.get(reason, 0) + 1
        self._drop_unheld([record])

    def _demote(self, record: BlockRecord, slot: TierSlot) -> None:
        """Copy an evicted block into the next slower tier that does not hold it yet."""
        assert self._hierarchy is not None
        lower_name = self._hierarchy.below(slot.name)
        if lower_name is None:
            return
        lower = self._slot(lower_name)
        if record.tier_mask & self._bit_of[lower_name]:
            return
        meta = self._meta(record)
        block = self._hierarchy.store(slot.name).get(meta)
        if block is None:
            return
        record.refcount += 1  # not a victim of the room it makes below
        try:
            self._admit(record, lower)
        except InsertRefused:
            return
        finally:
            record.refcount -= 1
        self._hierarchy.write(lower_name, meta, block)
        record.tier_mask |= self._bit_of[lower_name]
        self._counters[slot.name].demotions += 1

    # ---- loading ------------------------------------------------------------------------

    def load(
        self,
        lease: Lease,
        *,
        recompute_s_per_token: float | None = None,
        use_remote: bool = True,
        max_blocks: int | None = None,
    ) -> list[KVBlock]:
        """The payloads of the lease's cached prefix, in order, ready to copy into a request.

        Each block comes from the fastest tier holding it and, if that is not the fastest tier
        of all, is promoted there. A block that is missing or fails verification is dropped
        from that tier and the prefix is cut before it (the rest is recomputed, bit-identical
        by construction). A block whose load is estimated slower than recomputing it
        (``recompute_s_per_token`` from the worker) cuts the prefix too. Then, if a remote
        store is configured, the match is extended with the blocks it holds for the chain.
        ``lease.match`` is updated to what was actually loaded; ``max_blocks`` caps it (a
        request recomputes its last prompt block when it needs that block's logits).
        """
        if self._hierarchy is None:
            raise ValueError("load needs a cache that carries bytes (a TierHierarchy)")
        if lease.is_released:
            raise IndexInvariantError("load through a released lease")
        blocks: list[KVBlock] = []
        tiers: list[str] = []
        limit = len(lease.keys) if max_blocks is None else max(0, max_blocks)
        for record in lease._records[:limit]:
            loaded = self._load_one(record, recompute_s_per_token)
            if loaded is None:
                break
            blocks.append(loaded[0])
            tiers.append(loaded[1])
        with self._lock:
            for record in lease._records[len(blocks):]:
                record.refcount -= 1
            self._drop_unheld(reversed(lease._records[len(blocks):]))
            del lease._records[len(blocks):]
        if use_remote and self._hierarchy.remote is not None and len(blocks) < limit:
            for block in self._extend_from_remote(lease, limit):
                blocks.append(block)
                tiers.append(REMOTE)
        lease.match = self._make_match(lease._records, tuple(tiers), len(lease.keys),
                                       lease.match.num_token_mismatches)
        return blocks

    def _load_one(
        self, record: BlockRecord, recompute_s_per_token: float | None
    ) -> tuple[KVBlock, str] | None:
        assert self._hierarchy is not None
        while True:
            with self._lock:
                if record.tier_mask == 0:
                    return None
                tier = self._fastest_tier(record)
                meta = self._meta(record)
            estimate = self._hierarchy.estimate_load_s(tier, record.num_bytes)
            if (
                recompute_s_per_token is not None
                and estimate is not None
                and estimate > recompute_s_per_token * self.block_tokens
            ):
                with self._lock:
                    self._counters[tier].recomputed_instead += 1
                return None
            # No lock while reading: the lease's reference keeps the block in this tier.
            block = self._hierarchy.read(tier, meta)
            with self._lock:
                if block is None:
                    self._counters[tier].load_failures += 1
                    self._slot(tier).policy.discard(record.key)
                    record.tier_mask &= ~self._bit_of[tier]
                    continue  # try the next tier that holds it
                self._promote(record, meta, block, tier)
            return block, tier

    def _promote(self, record: BlockRecord, meta: BlockMeta, block: KVBlock, tier: str) -> None:
        assert self._hierarchy is not None
        top = self._tiers[0]
        top_bit = self._bit_of[top.name]
        if not self._promote_on_hit or tier == top.name or record.tier_mask & top_bit:
            return
        try:
            self._admit(record, top)
        except InsertRefused:
            return
        self._hierarchy.write(top.name, meta, block)
        record.tier_mask |= top_bit
        self._counters[tier].promotions += 1

    def _extend_from_remote(self, lease: Lease, limit: int) -> list[KVBlock]:
        """Fetch the chain after the local match from the remote store; admit what came."""
        assert self._hierarchy is not None
        start = len(lease._records)
        end = min(limit, len(lease.keys))
        if start >= end:
            return []
        fp = self.fingerprinter(lease.namespace)
        metas = []
        parent_key = lease.keys[start - 1] if start else fp.root_parent
        for i in range(start, end):
            metas.append(
                BlockMeta(
                    key=lease.keys[i],
                    parent_key=parent_key,
                    namespace_digest=lease.namespace.digest,
                    owner=lease.namespace.scope.owner,
                    tokens=fp.block_token_bytes(lease.tokens, i),
                )
            )
            parent_key = lease.keys[i]
        fetched = self._hierarchy.fetch_remote(metas)
        if not fetched:
            return []
        top = self._tiers[0]
        specs = [
            BlockSpec(key=m.key, tokens=m.tokens, num_bytes=b.nbytes)
            for m, b in zip(metas, fetched, strict=False)
        ]
        used: list[KVBlock] = []
        with self._lock:
            parent = lease._records[-1] if lease._records else None
            chain = self._index.insert(
                lease.namespace, parent, specs, now=self._clock(), ttl_s=None
            )
            for record in chain:
                record.refcount += 1
            for record, meta, block in zip(chain, metas, fetched, strict=False):
                if not record.tier_mask & self._bit_of[top.name]:
                    try:
                        self._admit(record, top)
                    except InsertRefused:
                        break
                    self._hierarchy.write(top.name, meta, block)
                    record.tier_mask |= self._bit_of[top.name]
                lease._records.append(record)
                used.append(block)
            for record in chain[len(used):]:
                record.refcount -= 1
            self._drop_unheld(reversed(chain[len(used):]))
            self._num_remote_hits += len(used)
        return used

    # ---- restart ------------------------------------------------------------------------

    def adopt(
        self, tier: str, found: Sequence[tuple[BlockMeta, int]], *, ttl_s: float | None = None
    ) -> int:
        """Index the blocks a store found on restart (e.g. the disk tier's files).

        Blocks are linked parents first; a block whose parent chain is incomplete is useless
        (only usable with all its ancestors) and is deleted from the store, as is anything the
        tier's policy cannot admit. ``found`` pairs each block's identity with its payload size
        (what the policy charges). Returns how many blocks were adopted.
        """
        slot = self._slot(tier)
        bit = self._bit_of[tier]
        sizes = {meta.key: size for meta, size in found}
        metas = [meta for meta, _ in found]
        children: dict[bytes, list[BlockMeta]] = {}
        for meta in metas:
            children.setdefault(meta.parent_key, []).append(meta)
        adopted = 0
        with self._lock:
            placed: set[BlockKey] = set()
            roots = [m for m in metas if m.parent_key == bytes(len(m.key))]
            stack: list[tuple[BlockMeta, BlockRecord | None]] = [(m, None) for m in roots]
            while stack:
                meta, parent = stack.pop()
                namespace = self._namespace_for(meta)
                spec = BlockSpec(key=meta.key, tokens=meta.tokens, num_bytes=sizes[meta.key])
                records = self._index.insert(namespace, parent, [spec], now=self._clock(),
                                             ttl_s=ttl_s)
                if not records:
                    continue
                record = records[0]
                if not record.tier_mask & bit:
                    record.refcount += 1
                    try:
                        self._admit(record, slot)
                    except InsertRefused:
                        continue
                    finally:
                        record.refcount -= 1
                    record.tier_mask |= bit
                placed.add(meta.key)
                adopted += 1
                stack.extend((child, record) for child in children.get(meta.key, []))
            for meta in metas:
                if meta.key not in placed:
                    stray = self._index.get(meta.key)
                    if stray is not None:
                        self._drop_unheld([stray])
                    if self._hierarchy is not None and (
                        stray is None or not stray.tier_mask & bit
                    ):
                        self._hierarchy.delete(tier, meta.key)
        return adopted

    def _namespace_for(self, meta: BlockMeta) -> Namespace:
        for namespace in self._index.namespaces():
            if namespace.digest == meta.namespace_digest:
                return namespace
        scope = Scope.shared() if meta.owner == "shared" else Scope.of_tenant(meta.owner)
        return Namespace(digest=meta.namespace_digest, scope=scope)

    def evict(self, tier: str, num_bytes: int, *, tenant: str | None = None) -> EvictionResult:
        """Free at least ``num_bytes`` in ``tier`` (``tenant``'s blocks only, when given)."""
        with self._lock:
            slot = self._slot(tier)
            return slot.policy.evict(
                num_bytes,
                tenant=tenant,
                can_evict=lambda key: self._can_evict(key, slot),
                remove=lambda key: self._remove_from_tier(key, slot, "admin"),
            )

    def sweep_expired(self) -> int:
        """Remove every expired block that nothing is using; returns how many left a tier."""
        with self._lock:
            return self._sweep_expired_locked()

    def _sweep_expired_locked(self) -> int:
        removed = 0
        for slot in self._tiers:
            result = slot.policy.sweep_expired(
                can_evict=partial(self._can_evict, slot=slot),
                remove=partial(self._remove_from_tier, slot=slot, reason="ttl"),
            )
            removed += len(result.victims)
        return removed

    def _slot(self, tier: str) -> TierSlot:
        bit = self._bit_of.get(tier)
        if bit is None:
            raise ValueError(f"unknown tier {tier!r}; tiers are {list(self._bit_of)}")
        return self._tiers[bit.bit_length() - 1]

    # ---- pinning ------------------------------------------------------------------------

    def set_pinned(self, namespace: Namespace, tokens: TokenIds, is_pinned: bool) -> int:
        """Pin (or unpin) the cached full blocks of ``tokens``; returns how many changed.

        A pinned block is never evicted and never expires; unpinning restarts its TTL.
        """
        keys = self.fingerprinter(namespace).block_keys(tokens)
        with self._lock:
            _, records, _ = self._match(namespace, tokens, keys)
            now = self._clock()
            changed = 0
            for record in records:
                if record.is_pinned != is_pinned:
                    record.is_pinned = is_pinned
                    changed += 1
                    if not is_pinned:
                        self._touch(record, now)
            return changed

    # ---- administration -----------------------------------------------------------------

    def list_prefixes(self, *, owner: str | None = None, limit: int = 100) -> list[PrefixInfo]:
        """One entry per cached prompt (a leaf of a trie), most recently used first.

        Args:
            owner: only this tenant's (or "shared") prefixes; None for all.
            limit: the most entries returned.
        """
        now = self._clock()
        with self._lock:
            leaves = [
                r for r in self._index.records()
                if not self._index.has_children(r)
                and (owner is None or r.namespace.scope.owner == owner)
            ]
            leaves.sort(key=lambda r: r.last_access, reverse=True)
            out = []
            for leaf in leaves[:limit]:
                path = self._path_to(leaf)
                mask = 0
                for record in path:
                    mask |= record.tier_mask
                out.append(
                    PrefixInfo(
                        owner=leaf.namespace.scope.owner,
                        key=leaf.key,
                        num_blocks=len(path),
                        num_tokens=len(path) * self.block_tokens,
                        num_bytes=sum(r.num_bytes for r in path),
                        tiers=tuple(t.name for t in self._tiers if mask & self._bit_of[t.name]),
                        idle_s=max(0.0, now - leaf.last_access),
                        num_hits=leaf.num_hits,
                        is_pinned=any(r.is_pinned for r in path),
                        first_block_tokens=path[0].tokens,
                    )
                )
            return out

    def _path_to(self, record: BlockRecord) -> list[BlockRecord]:
        path = []
        node: BlockRecord | None = record
        while node is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        return path

    def evict_where(
        self,
        *,
        owner: str | None = None,
        under: tuple[Namespace, TokenIds] | None = None,
        key: BlockKey | None = None,
        idle_s: float | None = None,
        tier: str | None = None,
    ) -> dict[str, int]:
        """Admin eviction: drop every block matching all the given selectors.

        Args:
            owner: blocks of this tenant (or "shared").
            under: blocks of the prompt ``tokens`` in ``namespace`` and everything after it.
            key: one block and everything after it.
            idle_s: blocks not used for at least this many seconds.
            tier: drop only the copies in this tier (default: every tier).

        Pinned blocks go too (an operator asked); blocks in use by a running request stay.
        A block is only dropped from a tier after its children there, so a selection that
        would orphan children keeps the parents it needs. Returns bytes freed per tier.
        """
        now = self._clock()
        with self._lock:
            selected: list[BlockRecord]
            if under is not None:
                namespace, tokens = under
                keys = self.fingerprinter(namespace).block_keys(tokens)
                _, records, _ = self._match(namespace, tokens, keys)
                if not records or len(records) < len(keys):
                    selected = []
                else:
                    # The prefix's own blocks and everything built on it; blocks of the prefix
                    # that other prompts still continue from stay (they are not leaves).
                    selected = records[:-1] + list(self._index.subtree(namespace, records[-1]))
            elif key is not None:
                start = self._index.get(key)
                selected = [] if start is None else list(
                    self._index.subtree(start.namespace, start))
            else:
                selected = list(self._index.records())
            selected = [
                r for r in selected
                if (owner is None or r.namespace.scope.owner == owner)
                and (idle_s is None or now - r.last_access >= idle_s)
            ]
            tiers = [self._slot(tier)] if tier is not None else self._tiers
            freed: dict[str, int] = {}
            # Deepest first, so that children leave before their parents.
            for record in sorted(selected, key=lambda r: r.depth, reverse=True):
                if record.key not in self._index or record.refcount:
                    continue
                for slot in tiers:
                    bit = self._bit_of[slot.name]
                    if not record.tier_mask & bit or self._index.has_child_in(record, bit):
                        continue
                    if record.tier_mask == bit and self._index.has_children(record):
                        continue
                    record.is_pinned = False
                    slot.policy.discard(record.key)
                    if self._hierarchy is not None:
                        self._hierarchy.delete(slot.name, record.key)
                    record.tier_mask &= ~bit
                    freed[slot.name] = freed.get(slot.name, 0) + record.num_bytes
                    evictions = self._counters[slot.name].evictions
                    evictions["admin"] = evictions.get("admin", 0) + 1
                self._drop_unheld([record])
            return freed

    def forget_remote(self, namespace: Namespace, tokens: TokenIds) -> int:
        """Delete every full block of ``tokens`` (in ``namespace``) from the remote store, so
        that no replica serves the prefix or anything after it. Returns how many blocks."""
        if self._hierarchy is None or self._hierarchy.remote is None:
            return 0
        fp = self.fingerprinter(namespace)
        keys = fp.block_keys(tokens)
        metas = []
        parent = fp.root_parent
        for i, key in enumerate(keys):
            metas.append(BlockMeta(key=key, parent_key=parent, namespace_digest=namespace.digest,
                                   owner=namespace.scope.owner,
                                   tokens=fp.block_token_bytes(tokens, i)))
            parent = key
        self._hierarchy.forget_remote(metas)
        return len(metas)

    def flush_remote(self, namespaces: Iterable[Namespace]) -> int:
        """Remove every remote block of these namespaces; how many keys went."""
        if self._hierarchy is None or self._hierarchy.remote is None:
            return 0
        return sum(self._hierarchy.flush_remote_namespace(ns.digest) for ns in namespaces)

    def known_namespaces(self) -> list[Namespace]:
        with self._lock:
            return self._index.namespaces()

    def set_quota(self, owner: str, num_bytes: int | None) -> None:
        """Cap what ``owner`` may hold in every tier (None: no cap)."""
        with self._lock:
            for slot in self._tiers:
                slot.policy.set_quota(owner, num_bytes)

    # ---- inspection ---------------------------------------------------------------------

    def refcount(self, key: BlockKey) -> int:
        with self._lock:
            record = self._index.get(key)
            return 0 if record is None else record.refcount

    def total_refcount(self) -> int:
        with self._lock:
            return sum(r.refcount for r in self._index.records())

    def tiers_of(self, key: BlockKey) -> tuple[str, ...]:
        with self._lock:
            record = self._index.get(key)
            if record is None:
                return ()
            return tuple(t.name for t in self._tiers if record.tier_mask & self._bit_of[t.name])

    def stats(self) -> CacheStats:
        with self._lock:
            self._forget_failed_writes()
            tiers = tuple(
                TierStats(
                    name=slot.name,
                    num_blocks=slot.policy.num_entries,
                    used_bytes=slot.policy.used_bytes,
                    budget_bytes=slot.policy.budget_bytes,
                    hits=self._counters[slot.name].hits,
                    inserts=self._counters[slot.name].inserts,
                    refused=self._counters[slot.name].refused,
                    promotions=self._counters[slot.name].promotions,
                    demotions=self._counters[slot.name].demotions,
                    load_failures=self._counters[slot.name].load_failures,
                    recomputed_instead=self._counters[slot.name].recomputed_instead,
                    evictions=dict(self._counters[slot.name].evictions),
                )
                for slot in self._tiers
            )
            return CacheStats(
                num_blocks=len(self._index),
                num_namespaces=len(self._index.namespaces()),
                num_token_mismatches=self._num_token_mismatches,
                num_remote_hits=self._num_remote_hits,
                tiers=tiers,
                stores=tuple(self._hierarchy.stats()) if self._hierarchy is not None else (),
            )

    def check_invariants(self) -> None:
        """Assert index structure and its agreement with every tier's policy (tests only)."""
        with self._lock:
            self._index.check_invariants()
            for slot in self._tiers:
                bit = self._bit_of[slot.name]
                held = {r.key for r in self._index.records() if r.tier_mask & bit}
                tracked = set(slot.policy.keys())
                if held != tracked:
                    raise IndexInvariantError(
                        f"tier {slot.name}: {len(held)} blocks held, {len(tracked)} tracked"
                    )
            for record in self._index.records():
                if record.tier_mask == 0 and not (
                    self._index.has_children(record) or record.refcount
                ):
                    raise IndexInvariantError("a block held by no tier outlived its use")
                parent = record.parent
                if parent is not None and parent.key not in self._index:
                    raise IndexInvariantError("a block outlived its parent")
