"""The prefix cache: matching a prompt, leasing its cached blocks, inserting the rest, pinning.

This is the one object the request path talks to, and the part of the cache that decides for a
request: which blocks of a prompt are cached and where, which of them a running request is
reading (a lease: nothing evicts them), which new blocks a tier admits, which are pinned. It
stands on ``gateway.cache.placement`` (the index, the tiers' policies and the reference counts:
who holds what, and the rules for changing that). What the bytes then do -- loading, promoting,
demoting, writing through, the remote tier -- is ``gateway.cache.transfers``, which asks
placement and carries out the byte moves it decided, after the lock; operators' selections are
``gateway.cache.operations.admin`` (the shared Redis tier's:
``gateway.cache.operations.remote_eviction``); indexing what a store kept over a restart is
``gateway.cache.operations.adoption``. None of them writes another's fields.

Rules it keeps with its placement (the invariants the property tests check):
  * a block is in the index exactly while at least one tier holds it;
  * a block with references (``refcount > 0``) or pinned is never evicted;
  * a block leaves a tier only when none of its children is held in that tier, and leaves the
    last tier only when it has no children at all: a block is only usable with all its
    ancestors. (If a demotion fails, a block with children stays in the index as a *ghost*,
    held by no tier; lookups stop at it and it leaves with its last descendant.)
  * a load that does not verify is a miss: the copy is dropped and the prefix is cut there;
  * an expired block (sliding TTL) is never returned by a lookup, and sweeping removes it;
  * all of it under one lock, so request threads, the sweeper and admin calls can mix; no
    store is read or written under it (placement queues the byte moves it decides, and they are
    carried out after: a block being moved is held, and not read where its bytes have not
    landed).

Every acquire is released by a context manager: ``with cache.acquire(ns, tokens) as lease:``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from gateway.cache.base import PinLog, TierEvents
from gateway.cache.leases import InsertResult, Lease, PrefixMatch
from gateway.cache.lossy_copies import write_lossy_copies
from gateway.cache.moves import ByteMove
from gateway.cache.pins import PinKeeper
from gateway.cache.placement import TierPlacement
from gateway.cache.radix_index import BlockRecord, BlockSpec
from gateway.cache.sessions import SessionLimits, SessionRegistry
from gateway.cache.tier_slot import TierSlot
from gateway.cache.transfers import TierTransfers
from gateway.core.admin_reports import StatsReport, StoreReport
from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import BlockFingerprinter, Namespace, lossy_namespace
from gateway.core.quantization import Quantization
from gateway.core.tokens import BYTES_PER_TOKEN, TokenIds, token_view
from policies.base import BlockKey, InsertRefused
from policies.stack import EvictionResult
from tiers.base import BlockMeta
from tiers.hierarchy import REMOTE, TierHierarchy
from tiers.payload import KVBlock

__all__ = ["InsertResult", "Lease", "PrefixCache", "PrefixMatch", "TierSlot"]


class PrefixCache:
    """Matching, leases, inserts and pins over a ``TierPlacement``: the request path's cache.

    Args:
        tiers: the local tiers, fastest first, each with its policy.
        block_tokens: tokens per block.
        hierarchy: the stores carrying the bytes, with the same tier names in the same order;
            None keeps metadata only (a block that leaves a tier is simply dropped from it).
        remote_write: write every newly inserted chain through to the remote (Redis) store.
        promote_on_hit: copy blocks loaded from a slower tier into the fastest one.
        clock: time source (seconds); injected so that TTL tests need no sleeping.
        key_bytes: block key size; only tests shrink it, to force collisions.
        wall_clock: Unix time (seconds), for the expiry written into a block's header.
        events: told of every copy a tier gains or loses (the KV-events publisher); None:
            nobody listens.
        sessions: how long a session lives and how many a tenant may have (``sessions``).
        remote_quantization: the lossy format the remote store keeps (None: exact copies).
        pin_log: where pins outlive the process (``gateway.cache.pins``); None: they do not.

    Raises:
        ValueError: the lossy tiers (local and remote) name more than one format: a prefix
            has one lossy namespace, and its copies live in the tiers of that format.
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
        wall_clock: Callable[[], float] = time.time,
        events: TierEvents | None = None,
        sessions: SessionLimits | None = None,
        remote_quantization: Quantization | None = None,
        pin_log: PinLog | None = None,
    ) -> None:
        formats = {t.quantization for t in tiers if t.quantization is not None}
        if remote_quantization is not None and hierarchy is not None and hierarchy.remote:
            formats.add(remote_quantization)
        if len(formats) > 1:
            raise ValueError(f"lossy tiers must share one format, got {sorted(formats)}")
        self._lossy_format: Quantization | None = next(iter(formats), None)
        self._placement = TierPlacement(
            tiers=tiers, block_tokens=block_tokens, hierarchy=hierarchy, clock=clock,
            key_bytes=key_bytes, wall_clock=wall_clock, events=events,
        )
        self._transfers = None if hierarchy is None else TierTransfers(
            hierarchy, self._placement, remote_write=remote_write,
            promote_on_hit=promote_on_hit, remote_quantization=remote_quantization)
        self.block_tokens = block_tokens
        self._block_bytes = block_tokens * BYTES_PER_TOKEN
        self._num_token_mismatches = 0
        self._sessions = SessionRegistry(self._placement, sessions or SessionLimits())
        self._pins = PinKeeper(self._placement, pin_log)

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The local tiers, fastest first."""
        return self._placement.tier_names

    @property
    def lossy_format(self) -> Quantization | None:
        """The format of the lossy copies some lower tier keeps (None: every tier is exact)."""
        return self._lossy_format

    def lossy_namespace(self, namespace: Namespace) -> Namespace | None:
        """Where the lossy copies of ``namespace``'s blocks live (None: no tier keeps any, or
        ``namespace`` is lossy already)."""
        if self._lossy_format is None or not namespace.exact:
            return None
        return lossy_namespace(namespace, self._lossy_format)

    @property
    def placement(self) -> TierPlacement:
        """Who holds what: what transfers, admin selection and adoption build on."""
        return self._placement

    @property
    def sessions(self) -> SessionRegistry:
        """Whose blocks are whose, and when each session was last used."""
        return self._sessions

    @property
    def transfers(self) -> TierTransfers | None:
        """What moves the bytes; None when the cache keeps metadata only."""
        return self._transfers

    # ---- reading ------------------------------------------------------------------------

    def fingerprinter(self, namespace: Namespace) -> BlockFingerprinter:
        """The (memoised) block keys of ``namespace``."""
        return self._placement.fingerprinter(namespace)

    def lookup(self, namespace: Namespace, tokens: TokenIds) -> PrefixMatch:
        """How much of ``tokens`` is cached locally in ``namespace``; changes nothing."""
        keys = self.fingerprinter(namespace).block_keys(tokens)
        with self._placement.locked():
            match, _, _ = self.match_records(namespace, tokens, keys)
            return match

    def match_records(
        self, namespace: Namespace, tokens: TokenIds, keys: list[BlockKey]
    ) -> tuple[PrefixMatch, list[BlockRecord], bool]:
        """Longest live cached prefix and its records (hold ``placement.locked()``); the flag
        says whether an expired block cut it short."""
        placement = self._placement
        result = placement.index.match(
            namespace, keys, token_data=token_view(tokens), block_bytes=self._block_bytes
        )
        now = placement.now()
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
            records, tuple(placement.fastest_tier(r) for r in records), len(keys),
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

    # ---- leases -------------------------------------------------------------------------

    @contextmanager
    def acquire(self, namespace: Namespace, tokens: TokenIds, *,
                to_load: bool = True) -> Iterator[Lease]:
        """Match ``tokens`` and hold their cached prefix until the ``with`` block ends.

        ``to_load``: plan where each block will be read (``Lease.plan``, in the same stay
        under the lock), for ``load``; False for a lease that only stores after its prefix
        (planning a long chain is a ``BlockMeta`` a block, on the engine's thread).

        A match counts as an access in every tier holding the block (LRU recency, TTL
        restart). It is not a hit: only blocks ``load`` serves to a request are counted as
        hits, so the engine's own acquires (storing an answer's blocks, looking at the shared
        scope beside the tenant's) never inflate them. Expired blocks met on the way are swept.
        """
        keys = self.fingerprinter(namespace).block_keys(tokens)
        placement = self._placement
        with placement.locked():
            match, records, met_expired = self.match_records(namespace, tokens, keys)
            now = placement.now()
            # Children first, so that recency orders ancestors after their descendants.
            for record in reversed(records):
                placement.touch(record, now)
            placement.hold(records)
            if met_expired:
                placement.sweep_expired()
            plan = (placement.plan_reads(records) if to_load and placement.carries_bytes
                    else None)
        lease = Lease(namespace=namespace, tokens=tokens, keys=keys, match=match, records=records,
                      plan=plan)
        try:
            yield lease
        finally:
            self._release(lease)

    def _release(self, lease: Lease) -> None:
        with self._placement.locked():
            self._placement.unhold(lease.end())

    def load(
        self,
        lease: Lease,
        *,
        recompute_s_per_token: float | None = None,
        use_remote: bool = True,
        max_blocks: int | None = None,
        start: int = 0,
    ) -> list[KVBlock]:
        """The payloads of the lease's cached prefix, in order, ready to copy into a request.

        Each block comes from the fastest tier holding it and, if that is not the fastest tier
        of all, is promoted there (``TierTransfers.load``). A block that is missing, fails
        verification, or would load slower than recomputing it (``recompute_s_per_token``
        from the worker) cuts the prefix there: the lease lets go of the rest. Then, if a remote
        store keeps the lease's namespace, the match is extended with the blocks it holds for
        the chain. ``lease.match`` is updated to what the lease holds; ``max_blocks`` caps it
        (a request recomputes its last prompt block when it needs that block's logits).
        ``start``: the first ``start`` blocks are served from elsewhere (a lossy lease after
        the exact prefix): they are held, not read, and the blocks returned begin after them.

        Raises:
            ValueError: the cache keeps metadata only.
            IndexInvariantError: the lease was released.
        """
        transfers = self._transfers
        if transfers is None:
            raise ValueError("load needs a cache that carries bytes (a TierHierarchy)")
        if lease.is_released:
            raise IndexInvariantError("load through a released lease")
        if lease.plan is None:
            raise IndexInvariantError("load through a lease acquired with to_load=False")
        limit = len(lease.keys) if max_blocks is None else max(0, max_blocks)
        first = min(max(0, start), limit)
        blocks: list[KVBlock] = []
        tiers: list[str] = []
        records = lease.records
        if len(records) > first:
            plan = lease.plan[first:limit]
            loaded = transfers.load(plan, recompute_s_per_token,
                                    let_go=records[first + len(plan):])
            blocks = [block for block, _ in loaded]
            tiers = [tier for _, tier in loaded]
            lease.cut(first + len(blocks))  # the load let their references go
        num_held = len(lease.records)
        if (max(num_held, first) < limit and use_remote
                and transfers.remote_holds(lease.namespace)):
            fetched = transfers.extend_from_remote(
                lease.namespace, lease.tokens, lease.keys, lease.records,
                min(limit, len(lease.keys)), recompute_s_per_token)
            lease.extend(record for record, _ in fetched)
            used = fetched[max(0, first - num_held):]
            blocks.extend(block for _, block in used)
            tiers.extend(REMOTE for _ in used)
        num_before = min(first, len(lease.records))
        before = [read.tiers[0] for read in lease.plan[:num_before]]
        before.extend("" for _ in range(len(before), num_before))
        lease.match = self._make_match(lease.records, (*before, *tiers), len(lease.keys),
                                       lease.match.num_token_mismatches)
        return blocks

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
        tag: str | None = None,
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
            tag: recorded on the lease's blocks up to there, the held ones and those stored
                now (a request's tag, carried to its store step: its prompt is not matched
                again to find them). The refused blocks do not get it.

        Returns:
            What was stored. Blocks that do not fit (quota, budget, or everything else pinned)
            are refused, not forced: they and everything after them are left out, and the
            result says why.

        Raises:
            ValueError: payloads missing where bytes are carried, or no size given.
            IndexInvariantError: the lease was released, or its blocks left the index.
        """
        if lease.is_released:
            raise IndexInvariantError("insert through a released lease")
        placement = self._placement
        slot = placement.slot(tier)
        start = lease.match.num_blocks
        end = len(lease.keys) if num_blocks is None else min(num_blocks, len(lease.keys))
        if blocks is not None:
            end = min(end, start + len(blocks))
            if lease.namespace.exact and any(
                    b.quantization is not None for b in blocks[:max(0, end - start)]):
                raise IndexInvariantError("a block dequantized from a lossy copy offered to an "
                                          "exact namespace")
        elif self._transfers is not None:
            raise ValueError("blocks are required when the cache carries bytes")
        elif block_bytes is None:
            raise ValueError("give either blocks or block_bytes")
        if end <= start:
            if tag is not None:
                with placement.locked():
                    for record in lease.records[:end]:
                        record.add_tag(tag)
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
        transfers = self._transfers
        failed = {} if transfers is None else transfers.drain_failed()
        with placement.locked():
            placement.forget_failed_writes(failed)
            held = lease.records
            parent = held[-1] if held else None
            if parent is not None and parent.key not in placement.index:
                raise IndexInvariantError("a leased block left the index")
            chain = placement.index.insert(lease.namespace, parent, specs, now=placement.now(),
                                           ttl_s=ttl_s)
            # Hold the chain while admitting it, so that making room never evicts a block of it.
            placement.hold(chain)
            try:
                result, stored = self.admit_chain(chain, len(specs), slot.name, blocks)
                if tag is not None:
                    num_kept = result.num_new_blocks + result.num_existing_blocks
                    for record in (*held[:start], *chain[:num_kept]):
                        record.add_tag(tag)
            finally:
                placement.unhold(chain)
            moves = placement.take_moves()
        if transfers is not None:
            transfers.run(moves)
            if transfers.remote_holds(lease.namespace):
                transfers.write_remote(stored)
            if blocks is not None:
                write_lossy_copies(self, lease, start, end, blocks, ttl_s)
        return result

    def admit_chain(
        self,
        chain: list[BlockRecord],
        num_wanted: int,
        tier: str,
        blocks: Sequence[KVBlock] | None,
    ) -> tuple[InsertResult, list[tuple[BlockMeta, KVBlock]]]:
        """Admit a freshly indexed ``chain`` (held by the caller) into ``tier``, as far as it
        fits: its new copies marked and, with ``blocks``, their writes queued; what is there
        already touched. Hold ``placement.locked()``. Returns the counts and what was queued."""
        placement = self._placement
        counters = placement.counters(tier)
        num_new = num_existing = num_evicted = 0
        refusal: str | None = None
        admitted = 0
        stored: list[tuple[BlockMeta, KVBlock]] = []
        now = placement.now()
        for i, record in enumerate(chain):
            if record.tier_mask:
                # Computed again by this request: it is live, whatever its TTL said.
                placement.touch(record, now)
            if placement.holds(record, tier):
                num_existing += 1
                admitted += 1
                continue
            try:
                num_evicted += placement.admit(record, tier)
            except InsertRefused as exc:
                refusal = str(exc)
                break
            placement.mark_held(record, tier)
            if blocks is not None and placement.carries_bytes:
                stored.append((placement.queue_write(record, tier, blocks[i]), blocks[i]))
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

    # ---- pinning and quotas -------------------------------------------------------------

    def set_pinned(self, namespace: Namespace, tokens: TokenIds, is_pinned: bool, *,
                   keep: bool = True) -> int:
        """Pin (or unpin) the cached full blocks of ``tokens``; returns how many changed.

        A pinned block is never evicted and never expires, here and in Redis (its keys lose
        their expiry), and is copied to a tier a restart finds where it has no copy there
        (``TierPlacement.keep_pinned_copies``); unpinning restarts its TTL, there too. Pins
        and unpins are saved to the pin log before this returns (``keep_pins``), so they
        outlive a kill -9; with ``keep`` False the caller saves them (the engine's loop leaves
        it to the warm's own thread).
        """
        keys = self.fingerprinter(namespace).block_keys(tokens)
        placement = self._placement
        with placement.locked():
            _, records, _ = self.match_records(namespace, tokens, keys)
            now = placement.now()
            changed: list[BlockRecord] = []
            for record in records:
                if placement.pins.set(record, is_pinned):
                    changed.append(record)
                    if not is_pinned:
                        placement.touch(record, now)
                        placement.track_expiry(record)
                if is_pinned:
                    placement.keep_pinned_copies(record)
            metas = [placement.meta(record) for record in changed]
            moves = placement.take_moves()
        self.run_moves(moves)
        if metas and self._transfers is not None:
            self._transfers.refresh_remote_expiry(metas)
        if keep:
            self.keep_pins()
        return len(changed)

    def keep_pins(self) -> None:
        """Save the pinned blocks' keys to the pin log if they changed (after an operator's
        eviction took a pinned block's last copy, or adoption); call it without the lock."""
        self._pins.keep()

    def set_quota(self, owner: str, num_bytes: int | None) -> None:
        """Cap what ``owner`` may hold in every tier (None: no cap)."""
        self._placement.set_quota(owner, num_bytes)

    def known_namespaces(self) -> list[Namespace]:
        """Every namespace with a block in the index."""
        with self._placement.locked():
            return self._placement.index.namespaces()

    # ---- eviction -----------------------------------------------------------------------

    def evict(self, tier: str, num_bytes: int, *, tenant: str | None = None) -> EvictionResult:
        """Free at least ``num_bytes`` in ``tier`` (``tenant``'s blocks only, when given);
        what it demotes is copied down after the lock."""
        placement = self._placement
        with placement.locked():
            result = placement.evict(tier, num_bytes, tenant=tenant)
            moves = placement.take_moves()
        self.run_moves(moves)
        return result

    def sweep_expired(self) -> int:
        """Remove every expired block that nothing is using; returns how many left a tier."""
        placement = self._placement
        with placement.locked():
            removed = placement.sweep_expired()
            moves = placement.take_moves()
        self.run_moves(moves)
        return removed

    def run_moves(self, moves: Sequence[ByteMove]) -> None:
        """Carry out the byte moves taken from the placement (``TierPlacement.take_moves``,
        under its lock), without the lock. Call it after letting go of the lock."""
        if self._transfers is not None:
            self._transfers.run(moves)

    # ---- inspection ---------------------------------------------------------------------

    def refcount(self, key: BlockKey) -> int:
        """References on ``key`` (0 when it is not cached)."""
        with self._placement.locked():
            record = self._placement.index.get(key)
            return 0 if record is None else record.refcount

    def total_refcount(self) -> int:
        """References on every block: 0 once every request has ended."""
        with self._placement.locked():
            return sum(r.refcount for r in self._placement.index.records())

    def tiers_of(self, key: BlockKey) -> tuple[str, ...]:
        """The tiers holding ``key``, fastest first."""
        with self._placement.locked():
            record = self._placement.index.get(key)
            return () if record is None else self._placement.tiers_in([record])

    def stats(self) -> StatsReport:
        """The index, each tier's policy view and counters, and each store's counters."""
        placement = self._placement
        transfers = self._transfers
        failed = {} if transfers is None else transfers.drain_failed()
        stores: tuple[StoreReport, ...] = () if transfers is None else transfers.stats()
        with placement.locked():
            placement.forget_failed_writes(failed)
            return StatsReport(
                tiers=placement.tier_stats(),
                num_blocks=len(placement.index),
                num_namespaces=len(placement.index.namespaces()),
                num_token_mismatches=self._num_token_mismatches,
                num_remote_hits=placement.num_remote_hits,
                stores=stores,
            )

    def check_invariants(self) -> None:
        """Assert index structure and its agreement with every tier's policy (tests only).

        Raises:
            IndexInvariantError: the first disagreement found.
        """
        self._placement.check_invariants()
