"""The records of a warm load: what to read where (``PlannedRead``), and what the reads brought
(``LoadReport``).

A load crosses placement twice at most, and the load itself once: the plan is made while the
lease is acquired, in the same stay under the lock that matches and holds the chain
(``TierPlacement.plan_reads``); the transfers read every planned block with no lock held,
trying a block's next planned tier where a copy fails; and one ``LoadReport`` tells placement
everything at once (``TierPlacement.settle_load``): promotions, failed copies, hits, the blocks
not served. A record here is data: neither side calls the other through it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from gateway.cache.moves import ByteMove
from gateway.cache.radix_index import BlockRecord
from tiers.base import BlockMeta
from tiers.payload import KVBlock


class PlannedRead(NamedTuple):
    """One block of a held chain and where it can be read.

    A named tuple rather than a frozen dataclass: one is made per block of every acquire, and
    a tuple is several times cheaper to make.

    Attributes:
        record: the block (held by the lease that planned it: nothing evicts it).
        tiers: the tiers whose copy could be read when it was planned, fastest first; a read
            that fails in one tries the next.
        meta: its identity in the stores.
    """

    record: BlockRecord
    tiers: tuple[str, ...]
    meta: BlockMeta


@dataclass(slots=True)
class LoadReport:
    """What the reads of a planned chain brought, for placement to settle in one stay.

    Attributes:
        served: the blocks served, in chain order, each with the tier it came from and its
            payload.
        failed: the copies that failed verification (the store dropped them), in order.
        recomputed_in: the tier whose read was judged slower than recomputing (the load
            stopped there), if any.
        let_go: the lease's blocks the load did not serve: their references go.
    """

    served: list[tuple[PlannedRead, str, KVBlock]] = field(default_factory=list)
    failed: list[tuple[BlockRecord, str]] = field(default_factory=list)
    recomputed_in: str | None = None
    let_go: list[BlockRecord] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SettledLoad:
    """Placement's answer to a ``LoadReport``.

    Attributes:
        moves: the byte moves its decisions need (the promoted blocks' writes, the victims'
            demotions), to carry out after the lock.
        promoted: indices into ``LoadReport.served`` of the blocks placed in the fastest tier.
    """

    moves: list[ByteMove]
    promoted: list[int]
