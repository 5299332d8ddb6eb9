"""``CacheConfig``: what the cache is made of, as one validated, frozen record.

A leaf: it imports the tier kinds' records (``tiers.kinds``), never a store, so that reading a
configuration file opens nothing and imports neither a store nor the Redis client
(``gateway.cache.operations.factory`` builds the stores from it). Its tiers are an
ordered list of records, one per ``[[cache.tier]]`` table; the old flat keys (``host_bytes``,
``disk_bytes``, ``redis_url``, ...) are still taken as keywords and still read as attributes
(``gateway.cache.legacy_keys``). """

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from gateway.cache.legacy_keys import (
    LEGACY_KEYS,
    TierListView,
    spelled_as_keys,
    tiers_of_keys,
)
from gateway.cache.lossy_tiers import quantize_problems
from gateway.core.quantization import QUANTIZATIONS
from gateway.core.sizes import GiB
from policies.registry import ORDER_POLICIES
from tiers.kinds.base import TierConfig
from tiers.kinds.registry import TIER_KINDS, tier_list_problems

DEFAULT_SESSION_TTL_S = 1800.0
DEFAULT_MAX_SESSIONS_PER_TENANT = 10_000
COMPRESSIONS = ("raw", "lz4", "auto")


@dataclass(frozen=True, slots=True, kw_only=True, init=False)
class CacheConfig(TierListView):
    """What the cache is made of.

    Attributes:
        block_tokens: tokens per block (the unit of storage and sharing).
        order: eviction order of every tier ("lru" or "clock").
        tiers: the tiers, fastest first: the device tier's record, then any of the other kinds
            (``tiers.kinds.registry.TIER_KINDS``), a remote one last. By default the device
            tier (2 GiB) and the host tier (4 GiB).
        quotas: bytes per tenant (applied in every tier), e.g. {"tenant-a": 2 * GiB}.
        tenant_quota: the quota of every tenant without one in ``quotas``, per tier name, e.g.
            {"device": GiB, "host": 2 * GiB}; a tier left out has none. Over its quota a tenant
            evicts only its own blocks, so one tenant's flood cannot push the others out.
        write_queue_bytes: block bytes queued for writing to disk, and to Redis, at most (each
            its own queue): past it new blocks are dropped (counted), never waited for; of a
            chain too big for the room left, its head is written. Size it to hold a few of the
            longest prompts' K/V (an 8k-token prompt of an 8B model is 1 GiB).
        compression: "raw" (default; lz4 saves ~1% on real KV) or "lz4" or "auto".
        reprobe_interval_s: a tier judged slower than recomputing is skipped, except for one
            probing load per this many seconds, so that it is used again once it is fast.
        skip_slow_tiers: a tier whose loads are measured slower than recomputing is skipped
            (the blocks are recomputed); False always loads (for a busy GPU, where
            recomputing takes compute from every other request).
        measure_at_start: ``kvgate serve`` measures the slow tiers' load bandwidth (disk,
            Redis), and the engine's recompute speed, before it serves
            (``gateway.cache.load_bandwidth``), so that the first hit on either tier is judged
            by ``skip_slow_tiers`` like every later one.
        sweep_interval_s: how often expired blocks are removed from every tier.
        session_ttl_s: a session (``CacheOptions.session_id``) ends this long after its last
            request: its own blocks and conversation tail leave every tier, Redis included.
        max_sessions_per_tenant: sessions one tenant may have on a replica at once; one more
            ends the tenant's least recently used session at the next sweep.

    The old keywords (``device_bytes``, ``host_bytes``, ``disk_bytes``, ``disk_path``,
    ``redis_url``, ..., ``quantize``) describe the same list (``legacy_keys.tiers_of_keys``);
    give them or ``tiers``, not both.

    Raises:
        ValueError: every problem, in one message (``problems()``).
    """

    block_tokens: int
    order: str
    tiers: tuple[TierConfig, ...]
    quotas: Mapping[str, int]
    tenant_quota: Mapping[str, int]
    write_queue_bytes: int
    compression: Literal["raw", "lz4", "auto"]
    reprobe_interval_s: float
    skip_slow_tiers: bool
    measure_at_start: bool
    sweep_interval_s: float
    session_ttl_s: float
    max_sessions_per_tenant: int

    def __init__(
        self,
        *,
        block_tokens: int = 64,
        order: str = "lru",
        tiers: Sequence[TierConfig] | None = None,
        quotas: Mapping[str, int] | None = None,
        tenant_quota: Mapping[str, int] | None = None,
        write_queue_bytes: int = GiB,
        compression: Literal["raw", "lz4", "auto"] = "raw",
        reprobe_interval_s: float = 10.0,
        skip_slow_tiers: bool = True,
        measure_at_start: bool = True,
        sweep_interval_s: float = 5.0,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        max_sessions_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT,
        **old_keys: Any,
    ) -> None:
        errors: list[str] = []
        given = {key: value for key, value in old_keys.items() if value is not None}
        unknown = sorted(set(old_keys) - LEGACY_KEYS)
        if unknown:
            raise TypeError(f"CacheConfig got unexpected keywords {unknown}")
        if tiers is not None and given:
            errors.append(f"give the tiers as a list or as the old keys {sorted(given)}, "
                          "not both")
        is_old = tiers is None
        if tiers is None:
            tiers, errors_of_keys = tiers_of_keys(given)
            errors += errors_of_keys
        set_ = object.__setattr__
        set_(self, "block_tokens", block_tokens)
        set_(self, "order", order)
        set_(self, "tiers", tuple(tiers))
        set_(self, "quotas", MappingProxyType(dict(quotas or {})))
        set_(self, "tenant_quota", MappingProxyType(dict(tenant_quota or {})))
        set_(self, "write_queue_bytes", write_queue_bytes)
        set_(self, "compression", compression)
        set_(self, "reprobe_interval_s", reprobe_interval_s)
        set_(self, "skip_slow_tiers", skip_slow_tiers)
        set_(self, "measure_at_start", measure_at_start)
        set_(self, "sweep_interval_s", sweep_interval_s)
        set_(self, "session_ttl_s", session_ttl_s)
        set_(self, "max_sessions_per_tenant", max_sessions_per_tenant)
        problems = self.problems()
        if is_old:
            problems = [spelled_as_keys(problem) for problem in problems]
        errors = list(dict.fromkeys(errors + problems))
        if errors:
            raise ValueError("invalid cache configuration: " + "; ".join(errors))

    def problems(self) -> list[str]:
        """Every problem with this configuration, for one message listing them all."""
        errors = []
        if self.block_tokens < 1:
            errors.append(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.order not in ORDER_POLICIES:
            errors.append(f"order must be one of {sorted(ORDER_POLICIES)}, got {self.order!r}")
        errors += self._tier_problems()
        for tenant, quota in self.quotas.items():
            if quota < 0:
                errors.append(f"quota of {tenant!r} must be >= 0")
        for name in ("reprobe_interval_s", "sweep_interval_s", "session_ttl_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value > 0):
                errors.append(f"{name} must be a positive number of seconds, got {value!r}")
        local = list(dict.fromkeys(kind.tier_name for kind in TIER_KINDS.values()
                                   if not kind.is_remote))
        for tier, quota in self.tenant_quota.items():
            if tier not in local:
                errors.append(f"tenant_quota names the tier {tier!r}; local tiers: "
                              f"{', '.join(local)} (Redis is bounded by its "
                              "write_bytes_per_s)")
            elif quota < 0:
                errors.append(f"tenant_quota of the {tier} tier must be >= 0")
        for name in ("skip_slow_tiers", "measure_at_start"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.write_queue_bytes < 1:
            errors.append("write_queue_bytes must be >= 1")
        if (not isinstance(self.max_sessions_per_tenant, int)
                or isinstance(self.max_sessions_per_tenant, bool)
                or not 1 <= self.max_sessions_per_tenant <= 10_000_000):
            errors.append(f"max_sessions_per_tenant must be an integer from 1 to 10000000, got "
                          f"{self.max_sessions_per_tenant!r}")
        if self.compression not in COMPRESSIONS:
            errors.append(f"compression must be raw, lz4 or auto, got {self.compression!r}")
        return errors

    def _tier_problems(self) -> list[str]:
        """The list's problems as a whole, then each tier's own, then their formats'."""
        errors = tier_list_problems([str(getattr(c, "kind", None)) for c in self.tiers])
        if errors:
            return errors
        for config in self.tiers:
            name = TIER_KINDS[config.kind].tier_name
            errors += [f"{name} tier: {problem}" for problem in config.problems()]
        formats = {TIER_KINDS[c.kind].tier_name: c.lossy_format for c in self.tiers
                   if c.lossy_format in QUANTIZATIONS}  # other values: the tier's own problem
        return errors + quantize_problems(formats)

    @property
    def persistent_path(self) -> Path | None:
        """The directory of the tier whose blocks outlive a restart (the disk tier's), or
        None without one."""
        for config in self.tiers:
            path = getattr(config, "path", None)
            if isinstance(path, Path):
                return path
        return None
