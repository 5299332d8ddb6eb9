"""Moving a block's bytes between tiers: load, promote, demote, write-through, the remote tier.

The prefix cache decides where a block may be (its policies, references and pins); this module
carries out what follows for the bytes, through the ``TierHierarchy`` of ``tiers``: reading a
matched prefix from the fastest tier that holds it (or recomputing when that is cheaper),
promoting what a hit read from a slower tier, copying what a tier evicts into the tier below,
writing new blocks through to the disk and Redis tiers, and extending a local match with the
blocks another replica left in Redis.

It asks before it places: every copy it adds to a tier goes through ``Placement.place``, the
prefix cache's admission (which may evict, and so demote, in turn), and every copy it finds
broken is forgotten through ``Placement.forget_copy``. It never touches a policy, a reference
count or a lease itself. ``PrefixCache`` satisfies ``Placement``; the protocol lives here so
that this module needs nothing of the cache above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from gateway.cache.radix_index import BlockRecord, BlockSpec, RadixIndex
from gateway.cache.stats import TierCounters
from gateway.core.fingerprint import BlockFingerprinter, Namespace
from gateway.core.tokens import TokenIds
from policies.base import BlockKey
from tiers.base import BlockMeta, StoreStats
from tiers.hierarchy import REMOTE, TierHierarchy
from tiers.payload import KVBlock


class Placement(Protocol):
    """The deciding side of the cache, as the transfers ask it (``PrefixCache``).

    Every method but ``locked`` expects the caller to hold ``locked()``.
    """

    @property
    def block_tokens(self) -> int:
        """Tokens per block."""
        ...

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The local tiers, fastest first."""
        ...

    @property
    def write_through_tiers(self) -> tuple[str, ...]:
        """Tiers that receive a copy of every newly inserted block."""
        ...

    @property
    def index(self) -> RadixIndex:
        """The radix index (read it, or insert into it, holding ``locked()``)."""
        ...

    def locked(self) -> AbstractContextManager[None]:
        """The cache's (reentrant) lock."""
        ...

    def now(self) -> float:
        """The cache's clock."""
        ...

    def fingerprinter(self, namespace: Namespace) -> BlockFingerprinter:
        """The block keys of ``namespace``."""
        ...

    def fastest_tier(self, record: BlockRecord) -> str:
        """The fastest tier holding ``record``."""
        ...

    def holds(self, record: BlockRecord, tier: str) -> bool:
        """Whether ``tier`` holds a copy of ``record``."""
        ...

    def meta(self, record: BlockRecord) -> BlockMeta:
        """The identity a store files ``record`` under."""
        ...

    def place(self, record: BlockRecord, tier: str) -> bool:
        """Admit ``record`` into ``tier`` (making room by eviction); False if refused."""
        ...

    def forget_copy(self, record: BlockRecord, tier: str) -> None:
        """``tier`` no longer holds ``record`` (its bytes are already gone)."""
        ...

    def counters(self, tier: str) -> TierCounters:
        """``tier``'s counters."""
        ...

    def hold(self, records: Iterable[BlockRecord]) -> None:
        """One more reference on each record."""
        ...

    def unhold(self, records: Sequence[BlockRecord]) -> None:
        """One reference less on each record; records nothing holds any more leave."""
        ...

    def note_remote_hits(self, num_blocks: int) -> None:
        """Count blocks served from the remote tier."""
        ...


class TierTransfers:
    """The bytes' moves of one prefix cache over one ``TierHierarchy``.

    Args:
        hierarchy: the stores, with the same tier names, in the same order, as the cache's.
        placement: the cache that decides what each tier may hold.
        remote_write: write every newly inserted chain through to the remote store.
        promote_on_hit: copy blocks loaded from a slower tier into the fastest one.
    """

    def __init__(
        self,
        hierarchy: TierHierarchy,
        placement: Placement,
        *,
        remote_write: bool = False,
        promote_on_hit: bool = True,
    ) -> None:
        self._hierarchy = hierarchy
        self._placement = placement
        self._remote_write = remote_write and hierarchy.remote is not None
        self._promote_on_hit = promote_on_hit

    @property
    def has_remote(self) -> bool:
        """Whether a remote (Redis) store is configured."""
        return self._hierarchy.remote is not None

    def can_demote_from(self, tier: str) -> bool:
        """Whether ``tier`` has a slower tier below it to demote into."""
        return self._hierarchy.below(tier) is not None

    def stats(self) -> tuple[StoreStats, ...]:
        """Each store's own counters."""
        return tuple(self._hierarchy.stats())

    # ---- writing ------------------------------------------------------------------------

    def store(self, record: BlockRecord, tier: str, block: KVBlock) -> tuple[BlockMeta, KVBlock]:
        """Write a block just placed in ``tier``, and through to every write-through tier that
        admits it. Returns what the remote write-through takes (``write_remote``)."""
        placement = self._placement
        meta = placement.meta(record)
        self._hierarchy.write(tier, meta, block)
        for other in placement.write_through_tiers:
            if other == tier or placement.holds(record, other):
                continue
            if placement.place(record, other):
                self._hierarchy.write(other, meta, block)
        return meta, block

    def write_remote(self, stored: list[tuple[BlockMeta, KVBlock]]) -> None:
        """Queue newly inserted blocks for the remote store (when writing through to it)."""
        if self._remote_write and stored:
            self._hierarchy.write_remote(stored)

    def delete(self, tier: str, key: BlockKey) -> None:
        """Remove ``key``'s bytes from ``tier``'s store."""
        self._hierarchy.delete(tier, key)

    def drain_failed(self) -> dict[str, list[BlockKey]]:
        """Per tier, the keys whose queued writes failed since the last call."""
        return self._hierarchy.drain_failed()

    def demote(self, record: BlockRecord, tier: str) -> None:
        """Copy a block that ``tier`` evicts into the next slower tier, if that admits it."""
        placement = self._placement
        lower = self._hierarchy.below(tier)
        if lower is None or placement.holds(record, lower):
            return
        meta = placement.meta(record)
        block = self._hierarchy.store(tier).get(meta)
        if block is None:
            return
        if not placement.place(record, lower):
            return
        self._hierarchy.write(lower, meta, block)
        placement.counters(tier).demotions += 1

    # ---- loading ------------------------------------------------------------------------

    def load(
        self, records: Sequence[BlockRecord], recompute_s_per_token: float | None
    ) -> list[tuple[KVBlock, str]]:
        """The payloads of ``records`` (a held chain) in order, each with the tier it came
        from, up to the first that is missing, fails verification, or would load slower than
        recomputing it (``recompute_s_per_token``, from the worker)."""
        loaded: list[tuple[KVBlock, str]] = []
        for record in records:
            one = self._load_one(record, recompute_s_per_token)
            if one is None:
                break
            loaded.append(one)
        return loaded

    def _load_one(
        self, record: BlockRecord, recompute_s_per_token: float | None
    ) -> tuple[KVBlock, str] | None:
        placement = self._placement
        while True:
            with placement.locked():
                if record.tier_mask == 0:
                    return None
                tier = placement.fastest_tier(record)
                meta = placement.meta(record)
            recompute_s = (None if recompute_s_per_token is None
                           else recompute_s_per_token * placement.block_tokens)
            if not self._hierarchy.worth_loading(tier, 1, record.num_bytes, recompute_s):
                with placement.locked():
                    placement.counters(tier).recomputed_instead += 1
                return None
            # No lock while reading: the lease's reference keeps the block in this tier.
            block = self._hierarchy.read(tier, meta)
            with placement.locked():
                if block is None:
                    placement.counters(tier).load_failures += 1
                    placement.forget_copy(record, tier)
                    continue  # try the next tier that holds it
                served = self._promote(record, meta, block, tier)
            return served, tier

    def _promote(self, record: BlockRecord, meta: BlockMeta, block: KVBlock,
                 tier: str) -> KVBlock:
        """Copy a block read from a slower ``tier`` into the fastest one; what to serve: the
        fastest tier's copy where it kept one (a page of the pool requests read in place)."""
        placement = self._placement
        top = placement.tier_names[0]
        if not self._promote_on_hit or tier == top or placement.holds(record, top):
            return block
        if placement.place(record, top):
            self._hierarchy.write(top, meta, block)
            placement.counters(top).promotions += 1  # counted where the copy went
            return self._hierarchy.store(top).get(meta) or block
        return block

    # ---- the remote tier ----------------------------------------------------------------

    def extend_from_remote(
        self,
        namespace: Namespace,
        tokens: TokenIds,
        keys: Sequence[BlockKey],
        held: Sequence[BlockRecord],
        end: int,
        recompute_s_per_token: float | None = None,
    ) -> list[tuple[BlockRecord, KVBlock]]:
        """Fetch the chain after the ``held`` prefix (up to block ``end``) from the remote
        store and place what came in the fastest tier -- unless the remote tier is judged
        slower than recomputing the chain (``recompute_s_per_token``, from the worker).

        Returns each block used with its record, which holds one reference for the caller's
        lease; blocks after the first the fastest tier refuses are not used.
        """
        placement = self._placement
        start = len(held)
        parent = held[-1] if held else None
        if start >= end:
            return []
        recompute_s = (None if recompute_s_per_token is None
                       else recompute_s_per_token * placement.block_tokens * (end - start))
        if not self._hierarchy.worth_loading(REMOTE, end - start, None, recompute_s):
            return []
        fp = placement.fingerprinter(namespace)
        metas = []
        parent_key = keys[start - 1] if start else fp.root_parent
        for i in range(start, end):
            metas.append(BlockMeta(key=keys[i], parent_key=parent_key,
                                   namespace_digest=namespace.digest,
                                   owner=namespace.scope.owner,
                                   tokens=fp.block_token_bytes(tokens, i)))
            parent_key = keys[i]
        fetched = self._hierarchy.fetch_remote(metas)
        if not fetched:
            return []
        top = placement.tier_names[0]
        specs = [
            BlockSpec(key=m.key, tokens=m.tokens, num_bytes=b.nbytes)
            for m, (b, _) in zip(metas, fetched, strict=False)
        ]
        used: list[tuple[BlockRecord, KVBlock]] = []
        with placement.locked():
            now = placement.now()
            chain = placement.index.insert(namespace, parent, specs, now=now, ttl_s=None)
            placement.hold(chain)
            for record, (block, expiry) in zip(chain, fetched, strict=False):
                if not record.tier_mask:
                    # New here: it keeps the TTL its header carries (a fetch is a use, and
                    # restarted its expiry in Redis too). A pin is not carried: it is local.
                    record.ttl_s = None if expiry is None else expiry.ttl_s
                    record.last_access = now
                if not placement.holds(record, top):
                    if not placement.place(record, top):
                        break
                    meta = placement.meta(record)
                    self._hierarchy.write(top, meta, block)
                    block = self._hierarchy.store(top).get(meta) or block
                used.append((record, block))
            placement.unhold(chain[len(used):])
            placement.note_remote_hits(len(used))
        return used

    def forget_remote(self, namespace: Namespace, tokens: TokenIds, *,
                      min_idle_s: float | None = None) -> int:
        """Delete every full block of ``tokens`` (in ``namespace``; with ``min_idle_s``, only
        those idle that long) from the remote store, so that no replica serves the prefix or
        anything after it. Returns how many blocks were named."""
        if self._hierarchy.remote is None:
            return 0
        fp = self._placement.fingerprinter(namespace)
        metas = []
        parent = fp.root_parent
        for i, key in enumerate(fp.block_keys(tokens)):
            metas.append(BlockMeta(key=key, parent_key=parent, namespace_digest=namespace.digest,
                                   owner=namespace.scope.owner,
                                   tokens=fp.block_token_bytes(tokens, i)))
            parent = key
        self._hierarchy.forget_remote(metas, min_idle_s=min_idle_s)
        return len(metas)

    def remove_remote_where(self, *, namespace_digest: bytes | None = None,
                            key: BlockKey | None = None, min_idle_s: float | None = None) -> int:
        """Remove the remote blocks of a namespace (None: every namespace of the deployment),
        of one block key, idle at least ``min_idle_s``; how many keys went."""
        return self._hierarchy.remove_remote_where(namespace_digest=namespace_digest, key=key,
                                                   min_idle_s=min_idle_s)

    def refresh_remote_expiry(self, metas: Sequence[BlockMeta]) -> None:
        """Give these blocks' remote copies the expiry their metas say (pin, unpin)."""
        self._hierarchy.refresh_remote_expiry(metas)

