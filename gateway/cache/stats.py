"""What the prefix cache counts, and the plain records ``stats`` reports.

Its own module because three sides write or read these figures -- the prefix cache (hits,
inserts, evictions), the transfers (promotions, demotions, failed loads) and the admin and
metrics surfaces above the cache -- and none of them should import another to reach them.

A tier's figures are reported as ``gateway.core.admin_reports.TierReport``, the record the
Admin service's client reads back too: one record from the cache to the operator, converted
to and from protobuf at the service's edge only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.core.admin_reports import TierReport
from policies.stack import TierPolicy
from tiers.base import StoreStats


@dataclass(slots=True)
class TierCounters:
    """Per-tier counters for ``stats``; mutable, owned by the prefix cache, bumped under its
    lock by the cache and by its transfers."""

    hits: int = 0
    inserts: int = 0
    refused: int = 0
    promotions: int = 0
    demotions: int = 0
    load_failures: int = 0
    recomputed_instead: int = 0
    evictions: dict[str, int] = field(default_factory=dict)

    def count_eviction(self, reason: str) -> None:
        """One block left the tier for ``reason`` ("capacity", "ttl", "admin")."""
        self.evictions[reason] = self.evictions.get(reason, 0) + 1


def tier_report(name: str, policy: TierPolicy, counters: TierCounters) -> TierReport:
    """One tier's figures as the prefix cache sees them (blocks, bytes, decisions): its
    policy's view and its counters."""
    return TierReport(
        name=name, num_blocks=policy.num_entries, used_bytes=policy.used_bytes,
        budget_bytes=policy.budget_bytes, hits=counters.hits, inserts=counters.inserts,
        refused=counters.refused, promotions=counters.promotions,
        demotions=counters.demotions, load_failures=counters.load_failures,
        recomputed_instead=counters.recomputed_instead,
        evictions=dict(counters.evictions))


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheStats:
    """Everything ``stats`` reports: the index, each tier's policy view, each store's counters.

    Plain data (dataclasses of ints, floats, strings and dicts), for the admin API and metrics.
    """

    num_blocks: int
    num_namespaces: int
    num_token_mismatches: int
    num_remote_hits: int
    tiers: tuple[TierReport, ...]
    stores: tuple[StoreStats, ...] = ()
