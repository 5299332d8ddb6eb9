"""Moving a block's bytes between tiers: load, promote, demote, write-through, the remote tier.

The prefix cache decides where a block may be (its policies, references and pins); this module
carries out what follows for the bytes, through the ``TierHierarchy`` of ``tiers``: reading a
matched prefix from the fastest tier that holds it (or recomputing when that is cheaper),
promoting what a hit read from a slower tier, copying what a tier evicts into the tier below,
writing new blocks through to the disk and Redis tiers, and extending a local match with the
blocks another replica left in Redis.

One direction: it asks, placement decides, and placement never calls back. Every copy it adds
to a tier goes through ``Placement.place`` (admission, which may evict and so demote in turn),
and every step that follows for the bytes -- this copy's write, the victims' demotions and
deletions -- placement queues as ``ByteMove``s under its lock; this module takes them before it
lets go of the lock and carries them out after (``run``), in order, so that no store is read or
written under the lock. It never touches a policy, a reference count or a lease itself.
``TierPlacement`` satisfies ``Placement``; the protocol lives here so that this module needs
nothing of the cache above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from gateway.cache.moves import ByteMove
from gateway.cache.radix_index import BlockRecord, BlockSpec, RadixIndex
from gateway.cache.stats import TierCounters
from gateway.core.fingerprint import BlockFingerprinter, Namespace
from gateway.core.quantization import Quantization
from gateway.core.tokens import TokenIds
from policies.base import BlockKey
from tiers.base import BlockExpiry, BlockMeta, StoreStats
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

    def readable_tier(self, record: BlockRecord) -> str | None:
        """The fastest tier whose copy of ``record`` can be read now."""
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

    def queue_write(self, record: BlockRecord, tier: str, block: KVBlock, *,
                    write_through: bool = True) -> BlockMeta:
        """Queue ``block``'s write into ``tier`` (placed there); returns its identity."""
        ...

    def take_moves(self) -> list[ByteMove]:
        """The byte moves decided since the last call, in order."""
        ...

    def settle(self, move: ByteMove, *, is_done: bool) -> None:
        """``move`` was carried out, or could not be."""
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
        placement: what decides what each tier may hold (``TierPlacement``).
        remote_write: write every newly inserted chain through to the remote store.
        promote_on_hit: copy blocks loaded from a slower tier into the fastest one.
        remote_quantization: the lossy format the remote store keeps (None: exact copies);
            it holds blocks of namespaces of that format only.
    """

    def __init__(
        self,
        hierarchy: TierHierarchy,
        placement: Placement,
        *,
        remote_write: bool = False,
        promote_on_hit: bool = True,
        remote_quantization: Quantization | None = None,
    ) -> None:
        self._hierarchy = hierarchy
        self._placement = placement
        self._remote_write = remote_write and hierarchy.remote is not None
        self._promote_on_hit = promote_on_hit
        self._remote_quantization = remote_quantization

    @property
    def has_remote(self) -> bool:
        """Whether a remote (Redis) store is configured."""
        return self._hierarchy.remote is not None

    @property
    def remote_quantization(self) -> Quantization | None:
        """The lossy format the remote store keeps (None: exact copies)."""
        return self._remote_quantization

    def remote_holds(self, namespace: Namespace) -> bool:
        """Whether the remote store keeps blocks of ``namespace`` (exact blocks in an exact
        store, a format's lossy blocks in a store of that format)."""
        return self.has_remote and namespace.quantization == self._remote_quantization

    @property
    def writes_remote(self) -> bool:
        """Whether newly inserted chains are written through to the remote store."""
        return self._remote_write

    def stats(self) -> tuple[StoreStats, ...]:
        """Each store's own counters."""
        return tuple(self._hierarchy.stats())

    # ---- writing ------------------------------------------------------------------------

    def run(self, moves: Sequence[ByteMove]) -> None:
        """Carry out ``moves`` (``Placement.take_moves``), in order, without the lock, then
        settle them under it. A copy whose source is gone is not done (placement forgets the
        copy it made room for); a step an error cut short is settled as not done."""
        if not moves:
            return
        done: list[bool] = []
        try:
            for move in moves:
                done.append(self._carry_out(move))
        finally:
            with self._placement.locked():
                for i, move in enumerate(moves):
                    self._placement.settle(move, is_done=i < len(done) and done[i])

    def _carry_out(self, move: ByteMove) -> bool:
        hierarchy = self._hierarchy
        if move.meta is None:
            hierarchy.delete(move.tier, move.key)
            return True
        block = move.block
        if block is None:
            assert move.source is not None
            block = hierarchy.store(move.source).get(move.meta)
            if block is None:
                return False
        hierarchy.write(move.tier, move.meta, block)
        return True

    def write_remote(self, stored: list[tuple[BlockMeta, KVBlock]]) -> None:
        """Queue newly inserted blocks for the remote store (when writing through to it)."""
        if self._remote_write and stored:
            self._hierarchy.write_remote(stored)

    def drain_failed(self) -> dict[str, list[BlockKey]]:
        """Per tier, the keys whose queued writes failed since the last call."""
        return self._hierarchy.drain_failed()

    # ---- loading ------------------------------------------------------------------------

    def load(
        self, records: Sequence[BlockRecord], recompute_s_per_token: float | None
    ) -> list[tuple[KVBlock, str]]:
        """The payloads of ``records`` (a held chain) in order, each with the tier it came
        from, up to the first that is missing, fails verification, or would load slower than
        recomputing it (``recompute_s_per_token``, from the worker).

        The whole chain in three steps: placement is asked once where each block can be read;
        each tier's run is read in one call with no lock held (a disk reads several blocks at
        once), if it is worth loading; placement is told once what came in (promotions,
        failures). A block that fails in its tier is retried from the next tier that holds it,
        one by one from there.
        """
        plan, blocks = self._read_chain(self._plan_load(records), recompute_s_per_token)
        loaded, promoted, failed_at = self._settle_load(plan, blocks)
        if promoted:
            # Serve the fastest tier's copies where it kept them (pages read in place).
            top = self._hierarchy.store(self._placement.tier_names[0])
            kept = top.get_many([plan[i][2] for i in promoted])
            for i, block in zip(promoted, kept, strict=True):
                if block is not None:
                    loaded[i] = (block, loaded[i][1])
        if failed_at is not None:
            for record in records[failed_at:]:
                one = self._load_one(record, recompute_s_per_token)
                if one is None:
                    break
                loaded.append(one)
        return loaded

    def _plan_load(
        self, records: Sequence[BlockRecord]
    ) -> list[tuple[BlockRecord, str, BlockMeta]]:
        """Each record with the tier to read it from and its identity, up to the first that no
        tier can serve now (one pass under the lock)."""
        placement = self._placement
        plan: list[tuple[BlockRecord, str, BlockMeta]] = []
        with placement.locked():
            for record in records:
                tier = placement.readable_tier(record)
                if tier is None:
                    break
                plan.append((record, tier, placement.meta(record)))
        return plan

    def _read_chain(
        self, plan: Sequence[tuple[BlockRecord, str, BlockMeta]],
        recompute_s_per_token: float | None,
    ) -> tuple[list[tuple[BlockRecord, str, BlockMeta]], list[KVBlock | None]]:
        """Read ``plan`` run by run (a tier's consecutive blocks in one call, no lock held), up
        to the first run judged slower than recomputing it or holding a failed read. A tier
        not measured yet, or judged slow (a probe), reads one block first: its time decides the
        rest of the run, so a slow tier costs one block before it is found out (Redis, whose
        one block is mostly a round trip, is measured on a whole chain: ``_fetch_remote``)."""
        read: list[tuple[BlockRecord, str, BlockMeta]] = []
        blocks: list[KVBlock | None] = []
        for tier, run in _runs(plan):
            hierarchy = self._hierarchy
            pieces = ([run[:1], run[1:]] if len(run) > 1 and (
                hierarchy.bandwidth(tier) is None or hierarchy.is_judged_slow(tier)) else [run])
            for piece in pieces:
                if not self._worth_loading(tier, piece, recompute_s_per_token):
                    return read, blocks
                got = self._hierarchy.read_many(
                    tier, [meta for _, _, meta in piece],
                    into_tier=self._placement.tier_names[0] if self._promote_on_hit else None)
                read.extend(piece)
                blocks.extend(got)
                if any(block is None for block in got):
                    return read, blocks
        return read, blocks

    def _worth_loading(self, tier: str, piece: Sequence[tuple[BlockRecord, str, BlockMeta]],
                       recompute_s_per_token: float | None) -> bool:
        """Whether to read ``piece`` from ``tier`` rather than recompute it (counted if not)."""
        placement = self._placement
        recompute_s = (None if recompute_s_per_token is None
                       else recompute_s_per_token * placement.block_tokens * len(piece))
        num_bytes = sum(record.num_bytes for record, _, _ in piece)
        if self._hierarchy.worth_loading(tier, len(piece), num_bytes, recompute_s):
            return True
        with placement.locked():
            placement.counters(tier).recomputed_instead += 1
        return False

    def _settle_load(
        self, plan: Sequence[tuple[BlockRecord, str, BlockMeta]],
        blocks: Sequence[KVBlock | None],
    ) -> tuple[list[tuple[KVBlock, str]], list[int], int | None]:
        """Tell placement what the reads brought, in one pass: promote what came from a slower
        tier, forget a copy that failed. Returns what loaded, the indices promoted, and the
        index of the first failure (None when every read block came in)."""
        placement = self._placement
        loaded: list[tuple[KVBlock, str]] = []
        promoted: list[int] = []
        failed_at: int | None = None
        with placement.locked():
            for index, ((record, tier, _), block) in enumerate(
                    zip(plan, blocks, strict=True)):
                if block is None:
                    placement.counters(tier).load_failures += 1
                    placement.forget_copy(record, tier)
                    failed_at = index
                    break
                if self._promote(record, block, tier):
                    promoted.append(index)
                loaded.append((block, tier))
            moves = placement.take_moves()
        self.run(moves)
        return loaded, promoted, failed_at

    def _load_one(
        self, record: BlockRecord, recompute_s_per_token: float | None
    ) -> tuple[KVBlock, str] | None:
        """One block from the fastest tier that serves it (after a failed read: the next)."""
        placement = self._placement
        while True:
            with placement.locked():
                tier = placement.readable_tier(record)
                if tier is None:
                    return None
                meta = placement.meta(record)
            recompute_s = (None if recompute_s_per_token is None
                           else recompute_s_per_token * placement.block_tokens)
            if not self._hierarchy.worth_loading(tier, 1, record.num_bytes, recompute_s):
                with placement.locked():
                    placement.counters(tier).recomputed_instead += 1
                return None
            # No lock while reading: the lease's reference keeps the block in this tier.
            block = self._hierarchy.read(tier, meta)
            is_promoted = False
            with placement.locked():
                if block is None:
                    placement.counters(tier).load_failures += 1
                    placement.forget_copy(record, tier)
                    moves = placement.take_moves()
                else:
                    is_promoted = self._promote(record, block, tier)
                    moves = placement.take_moves()
            self.run(moves)
            if block is None:
                continue  # try the next tier that holds it
            if is_promoted:
                # Serve the fastest tier's copy where it kept one (a page of the pool that
                # requests read in place).
                block = self._hierarchy.store(placement.tier_names[0]).get(meta) or block
            return block, tier

    def _promote(self, record: BlockRecord, block: KVBlock, tier: str) -> bool:
        """Place a block read from a slower ``tier`` in the fastest one (its write queued);
        whether it was."""
        placement = self._placement
        top = placement.tier_names[0]
        if not self._promote_on_hit or tier == top or placement.holds(record, top):
            return False
        if not placement.place(record, top):
            return False
        placement.queue_write(record, top, block, write_through=False)
        placement.counters(top).promotions += 1  # counted where the copy went
        return True

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
        if start >= end or not self.remote_holds(namespace):
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
        top = placement.tier_names[0]
        fetched = self._fetch_remote(metas, top, recompute_s_per_token)
        if not fetched:
            return []
        specs = [
            BlockSpec(key=m.key, tokens=m.tokens, num_bytes=b.nbytes)
            for m, (b, _) in zip(metas, fetched, strict=False)
        ]
        used: list[tuple[BlockRecord, KVBlock]] = []
        placed: list[BlockMeta | None] = []
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
                meta = None
                if not placement.holds(record, top):
                    if not placement.place(record, top):
                        break
                    meta = placement.queue_write(record, top, block, write_through=False)
                used.append((record, block))
                placed.append(meta)
            placement.unhold(chain[len(used):])
            placement.note_remote_hits(len(used))
            moves = placement.take_moves()
        self.run(moves)
        # Serve the fastest tier's copies where it kept them (pages read in place).
        store = self._hierarchy.store(top)
        return [(record, block if meta is None else store.get(meta) or block)
                for (record, block), meta in zip(used, placed, strict=True)]

    def _fetch_remote(self, metas: list[BlockMeta], top: str,
                      recompute_s_per_token: float | None,
                      ) -> list[tuple[KVBlock, BlockExpiry | None]]:
        """The longest prefix of ``metas`` worth fetching, fetched. A remote tier judged slow
        fetches one block first (a probe), whose time decides the rest: a Redis still slow
        costs one block, not the chain (on an H100 a Redis row of an 8B model's 8k-token chain
        had a 1.25 s sample, likely such a probe, where recomputing took 0.33 s). Not measured
        yet, it fetches the whole chain: one block's time would be mostly the round trip a
        pipelined chain pays once."""
        hierarchy = self._hierarchy
        per_block_s = (None if recompute_s_per_token is None
                       else recompute_s_per_token * self._placement.block_tokens)
        pieces = ([metas[:1], metas[1:]] if len(metas) > 1 and hierarchy.is_judged_slow(REMOTE)
                  else [metas])
        fetched: list[tuple[KVBlock, BlockExpiry | None]] = []
        for piece in pieces:
            recompute_s = None if per_block_s is None else per_block_s * len(piece)
            if not hierarchy.worth_loading(REMOTE, len(piece), None, recompute_s):
                break
            got = hierarchy.fetch_remote(piece, into_tier=top)
            fetched.extend(got)
            if len(got) < len(piece):
                break
        return fetched

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


def _runs(plan: Sequence[tuple[BlockRecord, str, BlockMeta]]
          ) -> list[tuple[str, list[tuple[BlockRecord, str, BlockMeta]]]]:
    """``plan`` cut into runs of consecutive entries read from the same tier."""
    runs: list[tuple[str, list[tuple[BlockRecord, str, BlockMeta]]]] = []
    for entry in plan:
        if runs and runs[-1][0] == entry[1]:
            runs[-1][1].append(entry)
        else:
            runs.append((entry[1], [entry]))
    return runs
