"""What the Admin service reports, as plain records: the cache and its stores make them
(``gateway.cache.stats``, ``gateway.cache.operations.admin`` and ``session_admin``; each store's
``stats`` in ``tiers``), the service turns them into protobuf replies and ``/metrics`` series,
``gateway.client`` builds them back from the replies, and ``kvgate admin`` prints them. One
record per report on both sides of the wire, converted only at its edges. Records only: nothing
here talks to a server.

A report is a snapshot, frozen once made. The live counters it is made from are another thing,
mutable and owned by whoever bumps them under their lock (``gateway.cache.stats.TierCounters``
for a tier, ``tiers.base.StoreCounters`` for a store); they never leave their owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class TierReport:
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
class StoreReport:
    """One store's figures at one moment (``BlockStore.stats``): its counters, and the figures
    only it keeps in ``notes``.

    NOTE: ``notes`` hold numbers where a store made them (``/metrics`` reads some,
    ``load_bytes_per_s`` and ``recomputed_instead``), and strings once read back over the wire:
    the protobuf's notes are a map of strings, and ``kvgate admin stats --json`` prints them as
    such. The counters default to 0 so that a store, or a test, names only what it counts.
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


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineReport:
    """How the engine computes ("batched" or "serial", and why; the dtype and device) and what
    it has computed. ``dtype`` and ``device`` are "" from a gateway older than them."""

    route: str
    route_reason: str
    steps: int
    prefill_tokens: int
    decode_tokens: int
    max_requests_in_step: int
    dedup_waits: int
    dtype: str = ""
    device: str = ""
    tail_hits: int = 0
    tail_tokens: int = 0
    tail_bytes: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StatsReport:
    """Everything ``Stats`` reports: the index, each tier's policy view and counters, each
    store's figures, and the engine's.

    The prefix cache makes it (``PrefixCache.stats``) with ``engine`` None: the cache does not
    know the engine, so the service adds it before the reply. ``engine`` is None too from a
    gateway that sent none.
    """

    num_blocks: int
    num_namespaces: int
    num_token_mismatches: int
    num_remote_hits: int
    tiers: tuple[TierReport, ...]
    stores: tuple[StoreReport, ...] = ()
    engine: EngineReport | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixInfo:
    tenant: str
    key_hex: str
    num_blocks: int
    num_tokens: int
    num_bytes: int
    tiers: tuple[str, ...]
    age_s: float
    idle_s: float
    num_hits: int
    is_pinned: bool
    preview: str
    tags: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Evicted:
    num_blocks: int
    bytes_by_tier: dict[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfo:
    """One session a replica knows (``ListSessions``): its blocks and bytes there (tail
    included), its tail's tokens, the seconds since its last request and until it ends."""

    tenant: str
    session_id: str
    num_blocks: int
    num_bytes: int
    tail_tokens: int
    idle_s: float
    expires_in_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionReset:
    """What ``ResetSession`` freed on the replica that took it (the others drop theirs)."""

    tenant: str
    num_blocks: int
    bytes_by_tier: dict[str, int]
    tail_bytes: int
