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
written under the lock, then posts how they went for placement to settle at its next stay
(``MoveOutcomes``) rather than calling it again. A warm load reads the plan its lease was
acquired with, lock-free, and tells placement what came in once (``settle_load``). It never
touches a policy, a reference count or a lease itself.
``TierPlacement`` satisfies ``Placement``; the protocol lives here so that this module needs
nothing of the cache above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from gateway.cache.load_plan import LoadReport, PlannedRead, SettledLoad
from gateway.cache.moves import ByteMove, MoveOutcomes
from gateway.cache.radix_index import BlockRecord, BlockSpec, RadixIndex
from gateway.core.admin_reports import StoreReport
from gateway.core.fingerprint import BlockFingerprinter, Namespace
from gateway.core.quantization import Quantization
from gateway.core.tokens import TokenIds
from policies.base import BlockKey
from tiers.base import BlockExpiry, BlockMeta
from tiers.hierarchy import REMOTE, TierHierarchy
from tiers.payload import KVBlock


class Placement(Protocol):
    """The deciding side of the cache, as the transfers ask it (``PrefixCache``).

    Every method but ``locked``, ``settle_load`` and the properties expects the caller to hold
    ``locked()``.
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
    def index(self) -> RadixIndex:
        """The radix index (read it, or insert into it, holding ``locked()``)."""
        ...

    def locked(self) -> AbstractContextManager[None]:
        """The cache's (reentrant) lock."""
        ...

    @property
    def move_outcomes(self) -> MoveOutcomes:
        """Where ``run`` posts the moves it carried out (settled at placement's next stay)."""
        ...

    def now(self) -> float:
        """The cache's clock."""
        ...

    def fingerprinter(self, namespace: Namespace) -> BlockFingerprinter:
        """The block keys of ``namespace``."""
        ...

    def holds(self, record: BlockRecord, tier: str) -> bool:
        """Whether ``tier`` holds a copy of ``record``."""
        ...

    def place(self, record: BlockRecord, tier: str) -> bool:
        """Admit ``record`` into ``tier`` (making room by eviction); False if refused."""
        ...

    def queue_write(self, record: BlockRecord, tier: str, block: KVBlock, *,
                    write_through: bool = True) -> BlockMeta:
        """Queue ``block``'s write into ``tier`` (placed there); returns its identity."""
        ...

    def plan_reads(self, records: Sequence[BlockRecord]) -> tuple[PlannedRead, ...]:
        """Where each of a held chain's blocks can be read now, fastest first."""
        ...

    def settle_load(self, report: LoadReport, *, promote_into: str | None) -> SettledLoad:
        """Take in what a load's reads brought, in one stay under the lock."""
        ...

    def take_moves(self) -> list[ByteMove]:
        """The byte moves decided since the last call, in order."""
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
        self._top = placement.tier_names[0]
        self._block_tokens = placement.block_tokens
        self._outcomes = placement.move_outcomes
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

    def stats(self) -> tuple[StoreReport, ...]:
        """Each store's report."""
        return tuple(self._hierarchy.stats())

    # ---- writing ------------------------------------------------------------------------

    def run(self, moves: Sequence[ByteMove]) -> None:
        """Carry out ``moves`` (``Placement.take_moves``), in order, without the lock, then post
        what became of them for placement to settle at its next stay (``MoveOutcomes``). A
        copy whose source is gone is not done (placement forgets the copy it made room for); a
        step an error cut short is posted as not done."""
        if not moves:
            return
        done: list[bool] = []
        try:
            for move in moves:
                done.append(self._carry_out(move))
        finally:
            self._outcomes.post(moves, done)

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
        self, plan: Sequence[PlannedRead], recompute_s_per_token: float | None, *,
        let_go: Sequence[BlockRecord] = (),
    ) -> list[tuple[KVBlock, str]]:
        """The payloads of ``plan`` (a held chain, planned by ``Placement.plan_reads``) in
        order, each with the tier it came from, up to the first block that no planned tier
        serves or that would load slower than recomputing it (``recompute_s_per_token``, from
        the worker). The chain's blocks not served, and ``let_go``, lose their references.

        Every read happens with no lock held; placement is told once, at the end, what came
        in (``Placement.settle_load``: promotions, failed copies, hits), and the moves it
        decides are carried out after (``run``).
        """
        placement = self._placement
        report = self._read_plan(plan, recompute_s_per_token)
        report.let_go = [read.record for read in plan[len(report.served):]]
        report.let_go.extend(let_go)
        settled = placement.settle_load(
            report, promote_into=self._top if self._promote_on_hit else None)
        self.run(settled.moves)
        loaded = [(block, tier) for _, tier, block in report.served]
        if settled.promoted:
            # Serve the fastest tier's copies where it kept them (pages read in place).
            kept = self._hierarchy.store(self._top).get_many(
                [report.served[i][0].meta for i in settled.promoted])
            for i, block in zip(settled.promoted, kept, strict=True):
                if block is not None:
                    loaded[i] = (block, loaded[i][1])
        return loaded

    def _read_plan(self, plan: Sequence[PlannedRead],
                   recompute_s_per_token: float | None) -> LoadReport:
        """Read ``plan`` with no lock held: each tier's run of consecutive blocks in one call
        while every read succeeds; after a failed copy, block by block, each from its planned
        tiers in order (a copy that fails is tried in the next tier that holds it).

        A tier not measured yet, or judged slow (a probe), reads one block of a run first: its
        time decides the rest of the run, so a slow tier costs one block before it is found
        out (Redis, whose one block is mostly a round trip, is measured on a whole chain:
        ``_fetch_remote``)."""
        report = LoadReport()
        hierarchy = self._hierarchy
        into = self._top if self._promote_on_hit else None
        for tier, run in _runs(plan):
            pieces = ([run[:1], run[1:]] if len(run) > 1 and (
                hierarchy.bandwidth(tier) is None or hierarchy.is_judged_slow(tier)) else [run])
            for piece in pieces:
                if not self._worth_loading(tier, piece, recompute_s_per_token):
                    report.recomputed_in = tier
                    return report
                got = hierarchy.read_many(tier, [read.meta for read in piece], into_tier=into)
                for read, block in zip(piece, got, strict=True):
                    if block is None:
                        report.failed.append((read.record, tier))
                        return self._read_one_by_one(plan, len(report.served),
                                                     recompute_s_per_token, report)
                    report.served.append((read, tier, block))
        return report

    def _read_one_by_one(self, plan: Sequence[PlannedRead], start: int,
                         recompute_s_per_token: float | None, report: LoadReport) -> LoadReport:
        """Read ``plan[start:]`` one block at a time (after a failed copy), each from its
        planned tiers in order but those that failed it already, up to the first that none of
        them serves."""
        failed = {(id(record), tier) for record, tier in report.failed}
        for read in plan[start:]:
            for tier in read.tiers:
                if (id(read.record), tier) in failed:
                    continue
                if not self._worth_loading(tier, [read], recompute_s_per_token):
                    report.recomputed_in = tier
                    return report
                block = self._hierarchy.read(tier, read.meta)
                if block is not None:
                    report.served.append((read, tier, block))
                    break
                report.failed.append((read.record, tier))
            else:
                return report
        return report

    def _worth_loading(self, tier: str, piece: Sequence[PlannedRead],
                       recompute_s_per_token: float | None) -> bool:
        """Whether to read ``piece`` from ``tier`` rather than recompute it."""
        recompute_s = (None if recompute_s_per_token is None
                       else recompute_s_per_token * self._block_tokens * len(piece))
        num_bytes = sum(read.record.num_bytes for read in piece)
        return self._hierarchy.worth_loading(tier, len(piece), num_bytes, recompute_s)

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
        top = self._top
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
                record.num_hits += 1
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
                       else recompute_s_per_token * self._block_tokens)
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


def _runs(plan: Sequence[PlannedRead]) -> list[tuple[str, list[PlannedRead]]]:
    """``plan`` cut into runs of consecutive blocks whose fastest planned tier is the same."""
    runs: list[tuple[str, list[PlannedRead]]] = []
    for read in plan:
        if runs and runs[-1][0] == read.tiers[0]:
            runs[-1][1].append(read)
        else:
            runs.append((read.tiers[0], [read]))
    return runs
