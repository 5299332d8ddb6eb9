"""The prefix cache: the radix index, each tier's policy and the reference counts, kept in step.

This is the one object the request path talks to for cache *metadata*: which blocks of a prompt
are cached and where, which of them a running request is reading (so nothing evicts them), and
which new blocks to admit into a tier and what to evict for them. Bytes themselves move in
``tiers``; this module decides, the tiers carry out.

Rules it keeps (the invariants the property tests check):
  * a block is in the index exactly while at least one tier holds it;
  * a block with references (``refcount > 0``) or pinned is never evicted;
  * a block leaves a tier only when none of its children is held in that tier, and leaves the
    cache altogether only when it has no children at all: a child is never left without its
    parent, because a block is only usable with all its ancestors;
  * an expired block (sliding TTL) is never returned by a lookup, and sweeping removes it;
  * all of it under one lock, so request threads, the sweeper and admin calls can mix.

Every acquire is released by a context manager: ``with cache.acquire(ns, tokens) as lease:``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

from gateway.errors import IndexInvariantError
from gateway.fingerprint import BlockFingerprinter, Namespace
from gateway.radix_index import BlockRecord, BlockSpec, RadixIndex
from gateway.tokens import BYTES_PER_TOKEN, TokenIds, token_view
from policies.base import BlockKey, InsertRefused, PolicyEntry
from policies.stack import EvictionResult, TierPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSlot:
    """One tier as the prefix cache sees it: a name and the policy that governs it."""

    name: str
    policy: TierPolicy


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


@dataclass(slots=True)
class TierCounters:
    """Per-tier counters for ``stats``."""

    hits: int = 0
    inserts: int = 0
    refused: int = 0
    evictions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    name: str
    num_blocks: int
    used_bytes: int
    budget_bytes: int
    hits: int
    inserts: int
    refused: int
    evictions: dict[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheStats:
    num_blocks: int
    num_namespaces: int
    num_token_mismatches: int
    tiers: tuple[TierStats, ...]


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
    """Radix index + tier policies + reference counts behind one lock.

    Args:
        tiers: the tiers, fastest first. Without byte movement (``tiers`` package) a block that
            leaves a tier is simply dropped from it.
        block_tokens: tokens per block.
        clock: time source (seconds); injected so that TTL tests need no sleeping.
        key_bytes: block key size; only tests shrink it, to force collisions.
    """

    def __init__(
        self,
        *,
        tiers: Sequence[TierSlot],
        block_tokens: int,
        clock: Callable[[], float] = time.monotonic,
        key_bytes: int = 16,
    ) -> None:
        if not tiers:
            raise ValueError("a prefix cache needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self._tiers = list(tiers)
        self._bit_of = {t.name: 1 << i for i, t in enumerate(tiers)}
        self._counters = {t.name: TierCounters() for t in tiers}
        self.block_tokens = block_tokens
        self._block_bytes = block_tokens * BYTES_PER_TOKEN
        self._clock = clock
        self._key_bytes = key_bytes
        self._index = RadixIndex()
        self._lock = threading.RLock()
        self._fingerprinters: dict[bytes, BlockFingerprinter] = {}
        self._num_token_mismatches = 0

    # ---- reading ------------------------------------------------------------------------

    def fingerprinter(self, namespace: Namespace) -> BlockFingerprinter:
        with self._lock:
            fp = self._fingerprinters.get(namespace.digest)
            if fp is None:
                fp = BlockFingerprinter(namespace, self.block_tokens, key_bytes=self._key_bytes)
                self._fingerprinters[namespace.digest] = fp
            return fp

    def lookup(self, namespace: Namespace, tokens: TokenIds) -> PrefixMatch:
        """How much of ``tokens`` is cached in ``namespace``; changes nothing."""
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
            if record.is_expired(now):
                met_expired = True
                break
            records.append(record)
        self._num_token_mismatches += result.num_token_mismatches
        tiers = tuple(self._fastest_tier(r) for r in records)
        num_blocks = len(records)
        match = PrefixMatch(
            num_blocks=num_blocks,
            num_tokens=num_blocks * self.block_tokens,
            keys=tuple(r.key for r in records),
            tiers=tiers,
            num_prompt_blocks=len(keys),
            diverges_at_block=None if num_blocks == len(keys) else num_blocks,
            num_token_mismatches=result.num_token_mismatches,
        )
        return match, records, met_expired

    def _fastest_tier(self, record: BlockRecord) -> str:
        for tier in self._tiers:
            if record.tier_mask & self._bit_of[tier.name]:
                return tier.name
        raise IndexInvariantError("a block in the index is held by no tier")

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

    # ---- writing ------------------------------------------------------------------------

    def insert(
        self,
        lease: Lease,
        *,
        tier: str,
        block_bytes: Sequence[int] | int,
        ttl_s: float | None = None,
        num_blocks: int | None = None,
    ) -> InsertResult:
        """Store the lease's not-yet-cached full blocks in ``tier``.

        Args:
            lease: the request's lease (its matched prefix is the parent of what is inserted).
            tier: where the blocks go.
            block_bytes: payload size of each new block (one int for all).
            ttl_s: sliding TTL of the new blocks; None for no expiry.
            num_blocks: insert only the prompt's first ``num_blocks`` full blocks.

        Blocks that do not fit (quota, budget, or everything else pinned) are refused, not
        forced: they and everything after them are left out, and the result says why.
        """
        if lease.is_released:
            raise IndexInvariantError("insert through a released lease")
        bit = self._bit_of.get(tier)
        if bit is None:
            raise ValueError(f"unknown tier {tier!r}; tiers are {list(self._bit_of)}")
        slot = self._tiers[bit.bit_length() - 1]
        end = len(lease.keys) if num_blocks is None else min(num_blocks, len(lease.keys))
        start = lease.match.num_blocks
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
                num_bytes=block_bytes if isinstance(block_bytes, int) else block_bytes[i - start],
            )
            for i in range(start, end)
        ]
        with self._lock:
            parent = lease._records[-1] if lease._records else None
            if parent is not None and parent.key not in self._index:
                raise IndexInvariantError("a leased block left the index")
            now = self._clock()
            chain = self._index.insert(lease.namespace, parent, specs, now=now, ttl_s=ttl_s)
            # Hold the chain while admitting it, so that making room never evicts a block of it.
            for record in chain:
                record.refcount += 1
            try:
                return self._admit_chain(chain, len(specs), slot, bit)
            finally:
                for record in chain:
                    if record.key in self._index:
                        record.refcount -= 1

    def _admit_chain(
        self,
        chain: list[BlockRecord],
        num_wanted: int,
        slot: TierSlot,
        bit: int,
    ) -> InsertResult:
        counters = self._counters[slot.name]
        num_new = num_existing = num_evicted = 0
        refusal: str | None = None
        admitted = 0
        now = self._clock()
        for record in chain:
            if record.tier_mask:
                # Computed again by this request: it is live, whatever its TTL said.
                self._touch(record, now)
            if record.tier_mask & bit:
                num_existing += 1
                admitted += 1
                continue
            entry = PolicyEntry(
                key=record.key,
                tenant=record.namespace.scope.owner,
                num_bytes=record.num_bytes,
                ttl_s=record.ttl_s,
            )
            try:
                result = slot.policy.admit(
                    entry,
                    can_evict=partial(self._can_evict, slot=slot),
                    remove=partial(self._remove_from_tier, slot=slot, reason="capacity"),
                )
            except InsertRefused as exc:
                refusal = str(exc)
                break
            num_evicted += len(result.victims)
            record.tier_mask |= bit
            num_new += 1
            admitted += 1
        counters.inserts += num_new
        # Whatever was not admitted and is held nowhere leaves the index, leaves first.
        for record in reversed(chain[admitted:]):
            if record.tier_mask == 0:
                record.refcount -= 1
                self._index.remove(record)
        num_refused = num_wanted - admitted
        counters.refused += num_refused
        return InsertResult(
            num_new_blocks=num_new,
            num_existing_blocks=num_existing,
            num_refused_blocks=num_refused,
            num_evicted_blocks=num_evicted,
            refusal=refusal if num_refused else None,
        )

    # ---- eviction -----------------------------------------------------------------------

    def _can_evict(self, key: BlockKey, slot: TierSlot) -> bool:
        record = self._index.get(key)
        if record is None or record.refcount or record.is_pinned:
            return False
        bit = self._bit_of[slot.name]
        if self._index.has_child_in(record, bit):
            return False
        if record.tier_mask == bit and self._index.has_children(record):
            return False  # its last copy: a child would be left without its parent
        return True

    def _remove_from_tier(self, key: BlockKey, slot: TierSlot, reason: str) -> None:
        record = self._index.get(key)
        if record is None:
            raise IndexInvariantError("evicting a block that is not in the index")
        bit = self._bit_of[slot.name]
        record.tier_mask &= ~bit
        evictions = self._counters[slot.name].evictions
        evictions[reason] = evictions.get(reason, 0) + 1
        if record.tier_mask == 0:
            self._index.remove(record)

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
            tiers = tuple(
                TierStats(
                    name=slot.name,
                    num_blocks=slot.policy.num_entries,
                    used_bytes=slot.policy.used_bytes,
                    budget_bytes=slot.policy.budget_bytes,
                    hits=self._counters[slot.name].hits,
                    inserts=self._counters[slot.name].inserts,
                    refused=self._counters[slot.name].refused,
                    evictions=dict(self._counters[slot.name].evictions),
                )
                for slot in self._tiers
            )
            return CacheStats(
                num_blocks=len(self._index),
                num_namespaces=len(self._index.namespaces()),
                num_token_mismatches=self._num_token_mismatches,
                tiers=tiers,
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
                if record.tier_mask == 0:
                    raise IndexInvariantError("a block in the index is held by no tier")
                parent = record.parent
                if parent is not None and parent.key not in self._index:
                    raise IndexInvariantError("a block outlived its parent")
