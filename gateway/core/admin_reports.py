"""What the Admin service reports, as plain records: the cache makes them
(``gateway.cache.stats``, ``gateway.cache.operations.admin`` and ``session_admin``), the service
turns them into protobuf replies, ``gateway.client`` builds them back from those, and
``kvgate admin`` prints them. One record per report on both sides of the wire, converted only
at its edges. Records only: nothing here talks to a server."""

from __future__ import annotations

from dataclasses import dataclass


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
    name: str
    num_blocks: int
    num_bytes: int
    hits: int
    misses: int
    puts: int
    deletes: int
    errors: int
    verification_failures: dict[str, int]
    is_available: bool
    notes: dict[str, str]


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
    num_blocks: int
    num_namespaces: int
    num_token_mismatches: int
    num_remote_hits: int
    tiers: tuple[TierReport, ...]
    stores: tuple[StoreReport, ...]
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
