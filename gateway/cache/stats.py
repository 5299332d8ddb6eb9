"""What the prefix cache counts per tier, and how a tier's counters become its report.

Its own module because three sides write or read these figures -- the prefix cache (hits,
inserts, evictions), the transfers (promotions, demotions, failed loads) and the admin and
metrics surfaces above the cache -- and none of them should import another to reach them.

A tier's figures are reported as ``gateway.core.admin_reports.TierReport`` inside a
``StatsReport`` (``PrefixCache.stats``), the records the Admin service's client reads back too:
one record from the cache to the operator, converted to and from protobuf at the service's edge
only. ``TierCounters`` are the live side: they never leave the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.core.admin_reports import TierReport
from policies.stack import TierPolicy


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

