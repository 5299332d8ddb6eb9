"""The seam every eviction and admission rule plugs into.

Policies decide which blocks a tier gives up and whether a new block may enter it. They see
keys, sizes, tenants and time, and nothing else: no tensors, files or sockets, so a policy can
be tested against a few lines of reference simulation and reused by every tier.

A tier composes several policies (see ``policies.stack.TierPolicy``): one *order* policy (LRU or
CLOCK) ranks ordinary victims, TTL contributes expired entries ahead of them, a quota limits
what one tenant may hold, a budget limits the whole tier. Each one is a small class behind the
``EvictionPolicy`` protocol below.

Errors (one root for the package)::

    PolicyError
     └── InsertRefused      an entry cannot fit without evicting what must stay
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NewType, Protocol, runtime_checkable

BlockKey = NewType("BlockKey", bytes)
"""The 16-byte keyed chain hash that addresses one block (see ``gateway.core.fingerprint``).

NOTE: defined here, in the lowest package, because policies, tiers and the gateway all pass
keys around and imports flow one way (policies <- tiers <- gateway)."""


class PolicyError(Exception):
    """Root of every error raised by ``policies``."""


class InsertRefused(PolicyError):
    """An entry cannot be admitted: it is larger than a limit, or the space it needs is held by
    blocks that may not be evicted (pinned, in use, or ancestors of such blocks)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyEntry:
    """What a policy knows about one block held by a tier.

    Attributes:
        key: the block's key.
        tenant: who is charged for it (the namespace's scope: a tenant id, or "shared").
        num_bytes: its size in this tier.
        ttl_s: seconds of idleness after which it expires, or None for no expiry. The TTL is
            sliding, as in hosted prompt-caching APIs: every access restarts it.
    """

    key: BlockKey
    tenant: str
    num_bytes: int
    ttl_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Shortfall:
    """Bytes that must leave before an entry fits under one policy's limit.

    ``tenant`` is None when any tenant's blocks may go (a tier budget), or the tenant whose own
    blocks must go (a quota: never another tenant's).
    """

    num_bytes: int
    tenant: str | None = None


@runtime_checkable
class EvictionPolicy(Protocol):
    """One rule of a tier's eviction and admission.

    Contract with the caller (``TierPolicy``):
      * ``on_insert`` is called once per key before any other call for it; ``on_remove`` once
        when the key leaves the tier (evicted or removed by other means). Keys are unique:
        inserting a tracked key raises ``ValueError``, and ``on_access`` or ``on_remove`` for an
        untracked key raises ``KeyError`` (both are caller bugs; ``tests/policies``'s
        conformance suite checks every implementation for them).
      * ``candidates`` yields keys this policy would give up, best victim first. It must not
        yield a removed key. The caller collects victims from it, closes it, and only then
        removes them; no other method is called while a ``candidates`` iterator is open. A
        policy may update its own bookkeeping while iterating (CLOCK clears reference bits).
      * ``shortfall`` returns what must be freed before ``entry`` fits, or None if it fits.
        It raises ``InsertRefused`` if the entry can never fit (larger than the limit itself).
    """

    def on_insert(self, entry: PolicyEntry) -> None:
        """Start tracking a key that just entered the tier."""
        ...

    def on_access(self, key: BlockKey) -> None:
        """Note that a tracked key was read (a cache hit)."""
        ...

    def on_remove(self, key: BlockKey) -> None:
        """Stop tracking a key that left the tier."""
        ...

    def candidates(self, tenant: str | None = None) -> Iterator[BlockKey]:
        """Keys to give up, best victim first; only ``tenant``'s when it is given."""
        ...

    def shortfall(self, entry: PolicyEntry) -> Shortfall | None:
        """What must leave before ``entry`` fits under this policy; None if it fits now."""
        ...
