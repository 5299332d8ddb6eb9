"""Which tier holds which block, and the rules for changing that: the tiers' side of the cache.

``TierPlacement`` keeps the radix index, each tier's eviction policy and counters, and the one
lock they share, and it is the only code that changes what a tier holds. Its rules are the
cache's invariants (docs/design.md, "The radix index" and "Blocks"): a block with references or a
pin is never a victim; a block leaves a tier only after its children there, and leaves its last
tier only when it has no children (or can move down); a record held by no tier and used by no
one leaves the index. It decides; it never moves a byte. What its decisions mean for the bytes
-- a victim copied into the tier below (a demotion), a copy deleted, a new block written -- it
queues as ``ByteMove`` steps (``gateway.cache.moves``), which the caller takes (``take_moves``)
before it lets go of the lock; ``TierTransfers`` carries them out after and posts how they went
(``move_outcomes``), settled here at the next stay. No store is read or written under the lock,
and nothing here calls the transfers. Until settled, a copy or write holds one reference on its
block, and a moving copy is neither read (``plan_reads``) nor placed again. A warm load asks
twice: its plan, made while its lease is acquired, and ``settle_load`` after its reads.

Every change of what a tier holds passes through ``mark_held``, ``forget_copy`` and eviction,
so an observer (``gateway.cache.base.TierEvents``: the KV-events publisher) is told of them
here. Every method but ``locked``, ``settle_load`` and those that say so expects its caller to
hold ``locked()``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

from gateway.cache.base import TierEvents
from gateway.cache.block_identity import BlockIdentity
from gateway.cache.expiry import ExpiryQueue
from gateway.cache.load_plan import LoadReport, PlannedRead, SettledLoad
from gateway.cache.moves import ByteMove, MoveOutcomes, MoveQueue
from gateway.cache.pins import PinnedBlocks
from gateway.cache.radix_index import BlockRecord, RadixIndex
from gateway.cache.stats import TierCounters, tier_report
from gateway.cache.tier_slot import TierSlot, TierSlots
from gateway.core.admin_reports import TierReport
from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import BlockFingerprinter, Namespace
from policies.base import BlockKey, InsertRefused, PolicyEntry
from policies.stack import EvictionResult
from tiers.base import BlockExpiry, BlockMeta
from tiers.hierarchy import TierHierarchy
from tiers.payload import KVBlock

SWEEP_RETRY_S = 1.0
"""An expired block that cannot go yet (in use, or a parent whose children stay) is looked at
again after this long."""


class TierPlacement:
    """The index, the tiers' policies and counters, and the lock: who holds what.

    Args:
        tiers: the local tiers, fastest first, each with its policy.
        block_tokens: tokens per block.
        hierarchy: the stores carrying the bytes, with the same tier names in the same order;
            None keeps metadata only (a block that leaves a tier is simply dropped from it).
        clock: time source (seconds).
        key_bytes: block key size; only tests shrink it, to force collisions.
        wall_clock: Unix time (seconds): a block's expiry leaves the process in wall time.
        events: told of every copy a tier gains or loses (None: nobody listens).

    Raises:
        ValueError: no tiers, duplicate names, names that differ from the hierarchy's, or
            ``block_tokens`` < 1.
    """

    def __init__(
        self,
        *,
        tiers: Sequence[TierSlot],
        block_tokens: int,
        hierarchy: TierHierarchy | None = None,
        clock: Callable[[], float] = time.monotonic,
        key_bytes: int = 16,
        wall_clock: Callable[[], float] = time.time,
        events: TierEvents | None = None,
    ) -> None:
        self._tiers = TierSlots(tiers)
        names = self._tiers.names
        if hierarchy is not None and names != hierarchy.names:
            raise ValueError(f"tiers {list(names)} do not match the hierarchy's "
                             f"{hierarchy.names}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self._bit_of = self._tiers.bit_of
        self._counters = {name: TierCounters() for name in names}
        self._block_tokens = block_tokens
        self._carries_bytes = hierarchy is not None
        self._clock = clock
        self._identity = BlockIdentity(block_tokens=block_tokens, key_bytes=key_bytes,
                                       clock=clock, wall_clock=wall_clock)
        self._index = RadixIndex()
        self._expiry = ExpiryQueue()
        self._lock = threading.RLock()
        self._num_remote_hits = 0
        self._events = events
        self._moves = MoveQueue()
        self._outcomes = MoveOutcomes()
        self.pins = PinnedBlocks()  # every pin and unpin goes through it (gateway.cache.pins)

    @property
    def block_tokens(self) -> int:
        """Tokens per block."""
        return self._block_tokens

    @property
    def tiers(self) -> TierSlots:
        """The local tiers, fastest first, and which of them hold a record."""
        return self._tiers

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The local tiers, fastest first."""
        return self._tiers.names

    @property
    def lossy_tiers(self) -> tuple[str, ...]:
        """Lower tiers that store lossy copies, fastest first."""
        return self._tiers.lossy

    @property
    def carries_bytes(self) -> bool:
        """Whether a hierarchy carries the bytes (False: metadata only, nothing moves)."""
        return self._carries_bytes

    @property
    def num_remote_hits(self) -> int:
        """Blocks served from the remote tier so far."""
        return self._num_remote_hits

    def fingerprinter(self, namespace: Namespace) -> BlockFingerprinter:
        """The (memoised) block keys of ``namespace`` (``BlockIdentity``); no lock needed."""
        return self._identity.fingerprinter(namespace)

    def slot(self, tier: str) -> TierSlot:
        """The tier named ``tier`` (ValueError, naming the tiers, if there is none)."""
        return self._tiers.slot(tier)

    # ---- who holds what ------------------------------------------------------------------

    @property
    def move_outcomes(self) -> MoveOutcomes:
        """Where the transfers post the moves they carried out; settled at the next stay."""
        return self._outcomes

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the cache's (reentrant) lock: a step of several placement calls is atomic.
        The moves carried out since the last stay are settled first."""
        with self._lock:
            if self._outcomes:
                for move, is_done in self._outcomes.take():
                    self.settle(move, is_done=is_done)
            yield

    @property
    def index(self) -> RadixIndex:
        """The radix index; change what tiers hold only through the methods below."""
        return self._index

    def now(self) -> float:
        """The cache's clock."""
        return self._clock()

    def to_monotonic(self, unix_s: float) -> float:
        """The cache-clock time of a wall-clock (Unix) time."""
        return self._identity.to_monotonic(unix_s)

    def expiry(self, record: BlockRecord) -> BlockExpiry | None:
        """``record``'s expiry as it leaves the process (``BlockIdentity.expiry``)."""
        return self._identity.expiry(record)

    def new_expiry(self, ttl_s: float | None) -> BlockExpiry | None:
        """The expiry of a copy stored now that no record tracks (``BlockIdentity``)."""
        return self._identity.new_expiry(ttl_s)

    def track_expiry(self, record: BlockRecord) -> None:
        """Watch ``record`` for the sweeper again (after an unpin, or a new TTL)."""
        self._expiry.push(record)

    def touch(self, record: BlockRecord, now: float) -> None:
        """An access: restart the block's TTL and tell every tier holding it."""
        record.last_access = now
        for slot in self._tiers.holding(record):
            slot.policy.access(record.key)

    def fastest_tier(self, record: BlockRecord) -> str:
        """The fastest tier holding ``record`` (IndexInvariantError if none does)."""
        return self._tiers.fastest(record)

    def is_moving(self, record: BlockRecord, tier: str) -> bool:
        """Whether a step decided for ``record``'s bytes in ``tier`` is not settled yet."""
        return self._moves.is_moving(record.key, tier)

    def holds(self, record: BlockRecord, tier: str) -> bool:
        """Whether ``tier`` holds a copy of ``record``."""
        return bool(record.tier_mask & self._bit_of[tier])

    def tiers_in(self, records: Iterable[BlockRecord]) -> tuple[str, ...]:
        """The tiers, fastest first, holding at least one of ``records``."""
        return self._tiers.holding_any(records)

    def may_leave(self, record: BlockRecord, tier: str) -> bool:
        """Whether ``tier``'s copy of ``record`` may go without orphaning a child: none of its
        children is in ``tier``, and it is not the last copy of a block with children."""
        bit = self._bit_of[tier]
        if not record.tier_mask & bit or self._index.has_child_in(record, bit):
            return False
        return not (record.tier_mask == bit and self._index.has_children(record))

    def meta(self, record: BlockRecord) -> BlockMeta:
        """The identity a store files ``record`` under (``BlockIdentity.meta``)."""
        return self._identity.meta(record)

    def plan_reads(self, records: Sequence[BlockRecord]) -> tuple[PlannedRead, ...]:
        """Where each of ``records`` (a held chain) can be read now, fastest first, up to the
        first no tier can serve (its bytes moving, or held nowhere)."""
        plan: list[PlannedRead] = []
        bits = self._bit_of.items()
        moving = self._moves.is_moving if self._moves else None
        for record in records:
            tiers = tuple([name for name, bit in bits if record.tier_mask & bit and not (
                moving is not None and moving(record.key, name))])
            if not tiers:
                break
            plan.append(PlannedRead(record, tiers, self.meta(record)))
        return tuple(plan)

    def settle_load(self, report: LoadReport, *, promote_into: str | None) -> SettledLoad:
        """Take in what a load's reads brought, in one stay under the lock (it takes it):
        failed copies forgotten, blocks from a slower tier placed in ``promote_into`` (writes
        queued), hits and recomputing counted, the blocks not served let go."""
        with self.locked():
            for record, tier in report.failed:
                self._counters[tier].load_failures += 1
                if self.holds(record, tier):
                    self.forget_copy(record, tier)
            promoted: list[int] = []
            for i, (read, tier, block) in enumerate(report.served):
                read.record.num_hits += 1
                if (promote_into is not None and tier != promote_into
                        and not self.holds(read.record, promote_into)
                        and self.place(read.record, promote_into)):
                    self.queue_write(read.record, promote_into, block, write_through=False)
                    self._counters[promote_into].promotions += 1  # counted where it went
                    promoted.append(i)
            for tier in {tier for _, tier, _ in report.served}:
                self._counters[tier].hits += 1
            if report.recomputed_in is not None:
                self._counters[report.recomputed_in].recomputed_instead += 1
            self.unhold(report.let_go)
            return SettledLoad(moves=self.take_moves(), promoted=promoted)

    def place(self, record: BlockRecord, tier: str) -> bool:
        """Admit ``record`` into ``tier``, evicting (and so demoting) others to make room;
        the record itself is never one of the victims. False if the tier refuses it, or its
        bytes there are still moving. The bytes are the caller's: ``queue_write``, or already
        in the store (adoption)."""
        if self.is_moving(record, tier):
            return False
        record.refcount += 1
        try:
            self.admit(record, tier)
        except InsertRefused:
            return False
        finally:
            record.refcount -= 1
        self.mark_held(record, tier)
        return True

    def mark_held(self, record: BlockRecord, tier: str) -> None:
        """``tier`` now holds ``record`` (which ``admit`` admitted there)."""
        bit = self._bit_of[tier]
        if record.tier_mask & bit:
            return
        if not record.tier_mask:
            self._expiry.push(record)  # newly cached: the sweeper watches it from now on
        record.tier_mask |= bit
        if self._events is not None and record.namespace.exact:
            # Lossy copies are not announced: a router would send exact requests their way.
            self._events.stored(self.meta(record), tier)

    def forget_copy(self, record: BlockRecord, tier: str) -> None:
        """``tier`` no longer holds ``record``: its policy and the record forget the copy.
        The bytes are the caller's business; ``drop_unheld`` removes a record left in no tier."""
        self.slot(tier).policy.discard(record.key)
        self._unmark(record, tier)

    def _unmark(self, record: BlockRecord, tier: str) -> None:
        """Clear ``tier``'s bit of ``record`` (and tell the observer, if it was set)."""
        bit = self._bit_of[tier]
        if not record.tier_mask & bit:
            return
        record.tier_mask &= ~bit
        if self._events is not None and record.namespace.exact:
            self._events.removed(record.key, tier)

    def tell_if_cleared(self) -> None:
        """After an eviction of everything: tell the observer that no tier holds anything,
        if that is so (a block a running request reads stays, and then nothing is said)."""
        if self._events is not None and not any(r.tier_mask for r in self._index.records()):
            self._events.cleared()

    def evict_copy(self, record: BlockRecord, tier: str, reason: str) -> None:
        """An operator's eviction: drop ``record``'s copy and bytes from ``tier``. A pin
        belongs to the block, not to one copy: it stays on the copies other tiers keep and
        goes only with the last one."""
        self.forget_copy(record, tier)
        if record.tier_mask == 0:
            self.pins.set(record, False)
        self.queue_delete(record.key, tier)
        self._counters[tier].count_eviction(reason)

    def keep_pinned_copies(self, record: BlockRecord) -> None:
        """Give pinned ``record`` a copy in each tier a restart finds again
        (``TierSlot.keeps_pins``) that has none: a block this replica read from another's
        (through Redis) or whose write there failed would otherwise lose its pin, and itself,
        with the process. Copied from its fastest tier after the lock."""
        if not self._carries_bytes or not record.tier_mask:
            return
        source = self.fastest_tier(record)
        for slot in self._tiers:
            if (slot.keeps_pins and not self.holds(record, slot.name)
                    and self._tiers.accepts(slot.name, record.namespace)
                    and self.place(record, slot.name)):
                self._queue(ByteMove(key=record.key, tier=slot.name, record=record,
                                     meta=self.meta(record), source=source))

    # ---- the bytes' steps ----------------------------------------------------------------

    def queue_write(self, record: BlockRecord, tier: str, block: KVBlock, *,
                    write_through: bool = True) -> BlockMeta:
        """``tier`` (which ``admit`` or ``place`` admitted ``record`` into) gets ``block``;
        with ``write_through``, so does every write-through tier that admits it. Returns the
        block's identity."""
        meta = self.meta(record)
        self._queue(ByteMove(key=record.key, tier=tier, record=record, meta=meta, block=block))
        if write_through:
            for other in self._tiers.write_through:
                if (other == tier or self.holds(record, other)
                        or not self._tiers.accepts(other, record.namespace)):
                    continue
                if self.place(record, other):
                    self._queue(ByteMove(key=record.key, tier=other, record=record, meta=meta,
                                         block=block))
        return meta

    def queue_delete(self, key: BlockKey, tier: str) -> None:
        """``key``'s bytes leave ``tier``'s store (no-op when the cache carries no bytes)."""
        self._queue(ByteMove(key=key, tier=tier))

    def _queue(self, move: ByteMove) -> None:
        if not self._carries_bytes:
            return
        if move.record is not None:
            move.record.refcount += 1
        self._moves.push(move)

    def take_moves(self) -> list[ByteMove]:
        """The steps decided since the last call, in order; the caller carries them out after
        letting go of the lock, then ``settle``s them."""
        return self._moves.take()

    def settle(self, move: ByteMove, *, is_done: bool) -> None:
        """``move`` was carried out (``is_done``) or could not be (its source copy was gone):
        its block is readable there again, or forgotten there; its reference goes."""
        self._moves.settled(move)
        record = move.record
        if record is None:
            return
        if is_done:
            if move.source is not None:
                self._counters[move.source].demotions += 1
        elif self.holds(record, move.tier):
            self.forget_copy(record, move.tier)
        self.unhold([record])

    def counters(self, tier: str) -> TierCounters:
        """``tier``'s counters (for ``stats``)."""
        return self._counters[tier]

    def hold(self, records: Iterable[BlockRecord]) -> None:
        """One more reference on each of ``records``: none of them can be evicted."""
        for record in records:
            record.refcount += 1

    def unhold(self, records: Sequence[BlockRecord]) -> None:
        """One reference less on each of ``records``; those held by no tier and no one leave
        the index (children first).

        Raises:
            IndexInvariantError: a reference count would go below zero.
        """
        for record in records:
            if record.refcount <= 0:
                raise IndexInvariantError("refcount would go below zero")
            record.refcount -= 1
        self.drop_unheld(reversed(records))

    def drop_unheld(self, records: Iterable[BlockRecord]) -> None:
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

    def note_remote_hits(self, num_blocks: int) -> None:
        """Count blocks served from the remote tier (``stats().num_remote_hits``)."""
        self._num_remote_hits += num_blocks

    def admit(self, record: BlockRecord, tier: str) -> int:
        """Make room for ``record`` in ``tier``'s policy and record it there (``mark_held``
        follows once its bytes are written); returns how many victims left.

        Raises:
            InsertRefused: the policy cannot make room (budget, quota, pins, references), or
                the block's bytes in ``tier`` are still moving.
        """
        if not self._tiers.accepts(tier, record.namespace):
            raise IndexInvariantError(
                f"a block of a {record.namespace.quantization or 'exact'} namespace offered to "
                f"the {tier} tier, which stores {self.slot(tier).quantization or 'exact'} copies")
        if self.is_moving(record, tier):
            raise InsertRefused("its copy in this tier is still being moved")
        entry = PolicyEntry(
            key=record.key,
            tenant=record.namespace.scope.owner,
            num_bytes=record.num_bytes,
            ttl_s=record.ttl_s,
        )
        slot = self.slot(tier)
        result = slot.policy.admit(
            entry,
            can_evict=partial(self._can_evict, slot=slot),
            remove=partial(self._remove_from_tier, slot=slot, reason="capacity"),
        )
        return len(result.victims)

    def forget_failed_writes(self, failed: dict[str, list[BlockKey]]) -> None:
        """Drop the tier copies whose queued writes failed (disk full, I/O error): per tier,
        the keys ``TierTransfers.drain_failed`` reported."""
        for tier, keys in failed.items():
            for key in keys:
                record = self._index.get(key)
                if record is not None and self.holds(record, tier):
                    self.forget_copy(record, tier)
                    self.drop_unheld([record])

    # ---- eviction -----------------------------------------------------------------------

    def evict(self, tier: str, num_bytes: int, *, tenant: str | None = None) -> EvictionResult:
        """Free at least ``num_bytes`` in ``tier`` (``tenant``'s blocks only, when given); the
        byte moves it decides are queued (``take_moves``)."""
        with self.locked():
            slot = self.slot(tier)
            return slot.policy.evict(
                num_bytes,
                tenant=tenant,
                can_evict=lambda key: self._can_evict(key, slot),
                remove=lambda key: self._remove_from_tier(key, slot, "admin"),
            )

    def sweep_expired(self) -> int:
        """Remove every expired block that nothing is using from every tier (no demotion: an
        expired block is gone, not moved down); returns how many tier copies left. The
        deletions are queued (``take_moves``).

        A block in use or pinned stays; a parent whose children stay keeps the copies they
        need (it is never served: a lookup stops at an expired block) and is looked at again.
        """
        with self.locked():
            now = self._clock()
            expired = self._expiry.pop_expired(now, lambda r: self._index.get(r.key) is r)
            removed = 0
            # Children first, so that their parents can leave in the same sweep.
            for record in sorted(expired, key=lambda r: r.depth, reverse=True):
                removed += self._drop_expired(record)
                if self._index.get(record.key) is record and record.tier_mask:
                    self._expiry.push(record, at=now + SWEEP_RETRY_S)
            self._expiry.compact(self._index.records(), len(self._index))
            return removed

    def _drop_expired(self, record: BlockRecord) -> int:
        if record.refcount or record.is_pinned:
            return 0
        removed = 0
        for slot in reversed(tuple(self._tiers)):  # slowest first: the last copy goes last
            if self.holds(record, slot.name) and self.may_leave(record, slot.name):
                self.forget_copy(record, slot.name)
                self.queue_delete(record.key, slot.name)
                self._counters[slot.name].count_eviction("ttl")
                removed += 1
        self.drop_unheld([record])
        return removed

    def _can_evict(self, key: BlockKey, slot: TierSlot) -> bool:
        record = self._index.get(key)
        if record is None or record.refcount or record.is_pinned:
            return False
        bit = self._bit_of[slot.name]
        if self._index.has_child_in(record, bit):
            return False
        if record.tier_mask == bit and self._index.has_children(record):
            # Its last copy: only if it can move down, or a child would lose its parent.
            return self._below(slot.name, record) is not None
        return True

    def _below(self, tier: str, record: BlockRecord) -> str | None:
        """The tier ``tier`` demotes ``record`` into (``TierSlots.below``), when bytes are
        carried."""
        return self._tiers.below(tier, record.namespace) if self._carries_bytes else None

    def _remove_from_tier(self, key: BlockKey, slot: TierSlot, reason: str) -> None:
        """A policy chose ``key`` as a victim in ``slot``: place it in the tier below (a
        demotion: its bytes are copied there, then deleted here, once the lock is let go),
        then drop it here."""
        record = self._index.get(key)
        if record is None:
            raise IndexInvariantError("evicting a block that is not in the index")
        lower = self._below(slot.name, record)
        if lower is not None and not self.holds(record, lower) and self.place(record, lower):
            # Queued after the steps that made room below, before the delete here.
            self._queue(ByteMove(key=key, tier=lower, record=record, meta=self.meta(record),
                                 source=slot.name))
        self.queue_delete(key, slot.name)
        self._unmark(record, slot.name)
        self._counters[slot.name].count_eviction(reason)
        self.drop_unheld([record])

    def set_quota(self, owner: str, num_bytes: int | None) -> None:
        """Cap what ``owner`` may hold in every tier (None: no cap)."""
        with self.locked():
            for slot in self._tiers:
                slot.policy.set_quota(owner, num_bytes)

    # ---- inspection ---------------------------------------------------------------------

    def tier_stats(self) -> tuple[TierReport, ...]:
        """Each tier's policy view and counters."""
        return tuple(tier_report(slot.name, slot.policy, self._counters[slot.name])
                     for slot in self._tiers)

    def check_invariants(self) -> None:
        """Assert docs/design.md's "The radix index" and "Blocks" (tests and property tests
        only; nothing on the request path): the index is well formed; each tier's policy tracks
        exactly the blocks the index says the tier holds; a block held by no tier lives only
        while it has children or references; no block outlives its parent; no byte move decided
        under the lock was left neither carried out nor posted (posted ones settled first).

        Raises:
            IndexInvariantError: the first disagreement found.
        """
        with self.locked():
            index = self._index
            index.check_invariants()
            if self._moves:
                raise IndexInvariantError(
                    f"{len(self._moves)} byte moves decided and never carried out")
            for slot in self._tiers:
                bit = self._bit_of[slot.name]
                held = {r.key for r in index.records() if r.tier_mask & bit}
                tracked = set(slot.policy.keys())
                if held != tracked:
                    raise IndexInvariantError(
                        f"tier {slot.name}: {len(held)} blocks held, {len(tracked)} tracked")
            for record in index.records():
                if record.tier_mask == 0 and not (index.has_children(record) or record.refcount):
                    raise IndexInvariantError("a block held by no tier outlived its use")
                parent = record.parent
                if parent is not None and parent.key not in index:
                    raise IndexInvariantError("a block outlived its parent")
