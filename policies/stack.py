"""One tier's whole eviction and admission policy, composed from the small ones.

A tier talks to a ``TierPolicy`` only. It combines one order policy (LRU or CLOCK) that ranks
ordinary victims, an optional TTL policy whose expired blocks go first, an optional per-tenant
quota, and the tier's byte budget. Composition keeps each rule a few lines with its own
reference-model tests, and lets a new rule arrive without editing the others.

The owner of the blocks (a tier, which knows the radix tree) decides which blocks may go: it
passes ``can_evict`` and ``remove`` callbacks, and this module decides which of the evictable
blocks go and in what order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, KeysView
from dataclasses import dataclass

from policies.base import BlockKey, EvictionPolicy, InsertRefused, PolicyEntry, Shortfall
from policies.budget import BudgetPolicy
from policies.quota import QuotaPolicy
from policies.ttl import TTLPolicy

logger = logging.getLogger(__name__)

CanEvict = Callable[[BlockKey], bool]
"""Whether the owner may give a block up right now (not pinned, not in use, no children)."""

Remove = Callable[[BlockKey], None]
"""Remove a block from the owner's tier; called only for a key ``CanEvict`` just allowed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionResult:
    """What one eviction, admission or sweep gave up.

    Attributes:
        victims: the keys removed, in the order ``remove`` was called for them.
        freed_bytes: the bytes they held.
        requested_bytes: the bytes that had to be freed.
    """

    victims: tuple[BlockKey, ...]
    freed_bytes: int
    requested_bytes: int

    @property
    def is_satisfied(self) -> bool:
        """Whether at least the requested bytes were freed."""
        return self.freed_bytes >= self.requested_bytes


_NOTHING = EvictionResult(victims=(), freed_bytes=0, requested_bytes=0)


class TierPolicy:
    """Decides what one tier admits and what it gives up to make room.

    The policies passed in must be fresh (tracking nothing): from then on this object calls
    every ``on_*`` method for them, and keeps its own key-to-entry map for sizes and tenants.

    Eviction runs in passes because the owner's ``can_evict`` depends on the shape of its tree:
    a parent becomes evictable only after its last child is removed, and the ``EvictionPolicy``
    contract forbids removing keys while a ``candidates`` iterator is open. A pass walks the
    candidates (TTL-expired blocks first, earliest expiry first, then the order policy's), keeps
    the evictable ones until they cover the remaining need, closes the iterators, then removes
    them. Passes repeat while the need is unmet and the last pass removed something.

    NOTE: a pass restarts its walk from the front, so blocks that cannot be evicted are walked
    again in each pass; a deep chain of victims costs one pass per level. Eviction requests are
    small next to a tier, so this stays cheap in practice.

    Args:
        budget_bytes: the tier's capacity.
        order: the policy that ranks ordinary victims (``LRUPolicy`` or ``ClockPolicy``).
        ttl: expiry of idle blocks; None to let blocks live until evicted. With None, an
            entry's ``ttl_s`` is ignored.
        quota: per-tenant caps; None for none.

    Raises:
        ValueError: ``budget_bytes`` is negative.
    """

    __slots__ = (
        "_budget",
        "_order",
        "_ttl",
        "_quota",
        "_policies",
        "_key_to_entry",
        "_tenant_to_bytes",
    )

    def __init__(
        self,
        *,
        budget_bytes: int,
        order: EvictionPolicy,
        ttl: TTLPolicy | None = None,
        quota: QuotaPolicy | None = None,
    ) -> None:
        self._budget = BudgetPolicy(budget_bytes)
        self._order = order
        self._ttl = ttl
        self._quota = quota
        self._policies: tuple[EvictionPolicy, ...] = tuple(
            p for p in (order, ttl, quota, self._budget) if p is not None
        )
        self._key_to_entry: dict[BlockKey, PolicyEntry] = {}
        # Kept here as well as in the quota policy, which is optional.
        self._tenant_to_bytes: dict[str, int] = {}

    # -- configuration -------------------------------------------------------------------------

    def set_quota(self, tenant: str, num_bytes: int | None) -> None:
        """Cap what ``tenant`` may hold in this tier (None: back to the default).

        A quota below current use is allowed: the tenant's next insert frees its own blocks.

        Raises:
            ValueError: this tier was built without a quota policy.
        """
        if self._quota is None:
            raise ValueError("this tier has no quota policy")
        self._quota.set_quota(tenant, num_bytes)

    def quota_of(self, tenant: str) -> int | None:
        return None if self._quota is None else self._quota.quota_of(tenant)

    # -- state ---------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """The bytes all tracked blocks hold."""
        return self._budget.used_bytes

    @property
    def budget_bytes(self) -> int:
        """The tier's capacity in bytes."""
        return self._budget.budget_bytes

    @property
    def num_entries(self) -> int:
        """How many blocks are tracked."""
        return len(self._key_to_entry)

    def used_bytes_of(self, tenant: str) -> int:
        """The bytes ``tenant``'s tracked blocks hold."""
        return self._tenant_to_bytes.get(tenant, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._key_to_entry

    def entry(self, key: BlockKey) -> PolicyEntry | None:
        """The entry a tracked block was admitted with, or None if it is not tracked."""
        return self._key_to_entry.get(key)

    def keys(self) -> KeysView[BlockKey]:
        """A live view of the tracked keys; do not change the policy while iterating it."""
        return self._key_to_entry.keys()

    def is_expired(self, key: BlockKey) -> bool:
        """Whether a tracked block's TTL has run out (always False without a TTL policy).

        Raises:
            KeyError: the key is not tracked.
        """
        if key not in self._key_to_entry:
            raise KeyError(key)
        return self._ttl is not None and self._ttl.is_expired(key)

    # -- changes -------------------------------------------------------------------------------

    def admit(self, entry: PolicyEntry, *, can_evict: CanEvict, remove: Remove) -> EvictionResult:
        """Make room for ``entry``, then start tracking it.

        An entry larger than the budget or its tenant's quota is refused before anything is
        evicted. Otherwise a quota shortfall is freed from the tenant's own blocks only, then a
        budget shortfall from anyone's.

        Args:
            entry: the block to admit.
            can_evict: whether the owner may give a block up right now.
            remove: removes a block from the owner's tier. It may also call ``discard`` for
                that key; this object forgets the key either way.

        Returns:
            The blocks evicted to make room (possibly none).

        Raises:
            ValueError: the key is already tracked, or the entry has a negative size or TTL
                (caller bugs).
            InsertRefused: the entry can never fit, or the room it needs is held by blocks
                that cannot be evicted. Blocks evicted before the refusal stay evicted; the
                entry is not tracked.
        """
        if entry.key in self._key_to_entry:
            raise ValueError(f"block {entry.key.hex()} is already in this tier")
        if entry.num_bytes < 0:
            raise ValueError(f"block {entry.key.hex()} has num_bytes={entry.num_bytes}; >= 0")
        if entry.ttl_s is not None and not entry.ttl_s >= 0:
            raise ValueError(f"block {entry.key.hex()} has ttl_s={entry.ttl_s!r}; >= 0 or None")
        # Both shortfall() calls raise InsertRefused for an entry larger than the limit itself,
        # so such an entry is refused before anything is evicted.
        phases: list[EvictionResult] = []
        if self._quota is not None:
            quota_shortfall = self._quota.shortfall(entry)
            self._budget.shortfall(entry)
            if quota_shortfall is not None:
                quota = self._quota.quota_of(entry.tenant)
                limit = f"the quota of tenant {entry.tenant!r} ({quota} B), from its own blocks"
                phases.append(self._make_room(entry, quota_shortfall, limit, can_evict, remove))
        budget_shortfall = self._budget.shortfall(entry)  # after the quota phase freed bytes
        if budget_shortfall is not None:
            limit = f"the tier's budget ({self.budget_bytes} B)"
            phases.append(self._make_room(entry, budget_shortfall, limit, can_evict, remove))

        self._key_to_entry[entry.key] = entry
        self._tenant_to_bytes[entry.tenant] = self.used_bytes_of(entry.tenant) + entry.num_bytes
        for policy in self._policies:
            policy.on_insert(entry)
        return EvictionResult(
            victims=tuple(key for phase in phases for key in phase.victims),
            freed_bytes=sum(phase.freed_bytes for phase in phases),
            requested_bytes=sum(phase.requested_bytes for phase in phases),
        )

    def evict(
        self,
        num_bytes: int,
        *,
        tenant: str | None = None,
        can_evict: CanEvict,
        remove: Remove,
    ) -> EvictionResult:
        """Free at least ``num_bytes``, or as much as the evictable blocks hold.

        Args:
            num_bytes: the bytes to free.
            tenant: take only this tenant's blocks; None for anyone's.
            can_evict: whether the owner may give a block up right now.
            remove: removes a block from the owner's tier.

        Returns:
            What was freed; ``is_satisfied`` is False when the target was not met.

        Raises:
            ValueError: ``num_bytes`` is negative.
        """
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        return self._evict(num_bytes, tenant, can_evict, remove)

    def sweep_expired(self, *, can_evict: CanEvict, remove: Remove) -> EvictionResult:
        """Remove every expired block that can be evicted.

        ``requested_bytes`` is what the blocks expired when the sweep began hold, so the result
        is unsatisfied exactly when some of them could not go (or were replaced by blocks that
        expired during the sweep).
        """
        if self._ttl is None:
            return _NOTHING
        ttl = self._ttl
        num_requested = sum(self._key_to_entry[key].num_bytes for key in ttl.candidates())
        victims: list[BlockKey] = []
        num_freed = 0
        while True:
            batch = [key for key in ttl.candidates() if can_evict(key)]
            if not batch:
                break
            num_freed += self._remove_batch(batch, remove, victims)
        return EvictionResult(
            victims=tuple(victims), freed_bytes=num_freed, requested_bytes=num_requested
        )

    def access(self, key: BlockKey) -> None:
        """Note a read of a tracked block (a cache hit): refreshes its rank and its TTL.

        Raises:
            KeyError: the key is not tracked.
        """
        if key not in self._key_to_entry:
            raise KeyError(key)
        for policy in self._policies:
            policy.on_access(key)

    def discard(self, key: BlockKey) -> None:
        """Forget a block that left the tier by other means; nothing happens if untracked."""
        entry = self._key_to_entry.pop(key, None)
        if entry is None:
            return
        used = self.used_bytes_of(entry.tenant) - entry.num_bytes
        if used:
            self._tenant_to_bytes[entry.tenant] = used
        else:  # used_bytes_of() reads a missing tenant as 0, so the map stays small
            self._tenant_to_bytes.pop(entry.tenant, None)
        for policy in self._policies:
            policy.on_remove(key)

    # -- eviction mechanics --------------------------------------------------------------------

    def _evict(
        self, num_bytes: int, tenant: str | None, can_evict: CanEvict, remove: Remove
    ) -> EvictionResult:
        victims: list[BlockKey] = []
        num_freed = 0
        while num_freed < num_bytes:
            batch = self._collect(num_bytes - num_freed, tenant, can_evict)
            if not batch:
                break
            num_freed += self._remove_batch(batch, remove, victims)
        return EvictionResult(
            victims=tuple(victims), freed_bytes=num_freed, requested_bytes=num_bytes
        )

    def _collect(self, num_bytes: int, tenant: str | None, can_evict: CanEvict) -> list[BlockKey]:
        """One pass: evictable keys, best first, until they hold ``num_bytes`` or run out."""
        batch: list[BlockKey] = []
        seen: set[BlockKey] = set()  # a key both expired and ranked by the order counts once
        num_batch_bytes = 0
        for source in self._victim_sources(tenant):
            try:
                for key in source:
                    if key in seen:
                        continue
                    seen.add(key)
                    if not can_evict(key):
                        continue
                    batch.append(key)
                    num_batch_bytes += self._key_to_entry[key].num_bytes
                    if num_batch_bytes >= num_bytes:
                        return batch
            finally:
                _close(source)
        return batch

    def _victim_sources(self, tenant: str | None) -> Iterator[Iterator[BlockKey]]:
        # Created one at a time, so that at most one candidates iterator is open.
        if self._ttl is not None:
            yield self._ttl.candidates(tenant)
        yield self._order.candidates(tenant)

    def _remove_batch(self, batch: list[BlockKey], remove: Remove, victims: list[BlockKey]) -> int:
        """Remove collected keys through the owner, forget them, return the bytes freed."""
        num_freed = 0
        for key in batch:
            entry = self._key_to_entry.get(key)
            if entry is None:  # the owner's earlier removal in this batch took it too
                continue
            remove(key)
            self.discard(key)  # a no-op if ``remove`` already called it
            victims.append(key)
            num_freed += entry.num_bytes
        return num_freed

    def _make_room(
        self,
        entry: PolicyEntry,
        shortfall: Shortfall,
        limit: str,
        can_evict: CanEvict,
        remove: Remove,
    ) -> EvictionResult:
        """Free one limit's shortfall, or refuse ``entry`` saying what held the space."""
        result = self._evict(shortfall.num_bytes, shortfall.tenant, can_evict, remove)
        if not result.is_satisfied:
            raise self._refusal(entry, result, limit)
        return result

    def _refusal(self, entry: PolicyEntry, result: EvictionResult, limit: str) -> InsertRefused:
        num_missing = result.requested_bytes - result.freed_bytes
        logger.debug(
            "refused block %s: %d of %d B freed under %s",
            entry.key.hex(),
            result.freed_bytes,
            result.requested_bytes,
            limit,
        )
        return InsertRefused(
            f"cannot admit block {entry.key.hex()} ({entry.num_bytes} B, tenant "
            f"{entry.tenant!r}): {result.requested_bytes} B had to be freed to stay within "
            f"{limit}, but only {result.freed_bytes} B could be evicted; the other "
            f"{num_missing} B are held by blocks that cannot be evicted (pinned, in use, or "
            f"ancestors of such blocks)"
        )


def _close(iterator: Iterator[BlockKey]) -> None:
    """Close a candidates iterator if it is a generator (plain iterators hold nothing)."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
