"""One tier as the cache sees it (``TierSlot``): what ``gateway.cache.placement`` is built over."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.quantization import Quantization
from policies.stack import TierPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSlot:
    """One tier as the prefix cache sees it: a name, the policy that governs it, and whether
    every inserted block is also written to it at once (write-through: the disk tier, so that
    a restart finds what was hot, not only what had been demoted)."""

    name: str
    policy: TierPolicy
    write_through: bool = False
    quantization: Quantization | None = None
    """The lossy format a lower tier stores (``[cache] quantize``), None for exact copies. The
    fastest tier holds pages of every namespace (a lossy request's pages sit beside the exact
    ones, under their lossy keys); a lower tier holds only blocks of namespaces of its own
    format, so an exact block never lands in a lossy tier nor a lossy one in an exact tier
    (docs/design.md, "Lossy tiers")."""
