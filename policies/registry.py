"""Names for order policies, and the one place a tier's policy is built from its config.

A new order policy is one new module plus one line in ``ORDER_POLICIES``; nothing else picks
between policies (no if/elif on names anywhere).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from policies.base import EvictionPolicy
from policies.clock import ClockPolicy
from policies.lru import LRUPolicy
from policies.quota import QuotaPolicy
from policies.stack import TierPolicy
from policies.ttl import TTLPolicy

ORDER_POLICIES: Mapping[str, Callable[[], EvictionPolicy]] = MappingProxyType(
    {"lru": LRUPolicy, "clock": ClockPolicy}
)
"""Order policy name to factory; read-only so that no caller can register behind our back."""


def _valid_order_names() -> str:
    return ", ".join(repr(name) for name in sorted(ORDER_POLICIES))


def make_order_policy(name: str) -> EvictionPolicy:
    """A fresh order policy (one that ranks ordinary victims) by its registered name.

    Raises:
        ValueError: no order policy has that name; the message lists the valid ones.
    """
    try:
        factory = ORDER_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown order policy {name!r}; valid names: {_valid_order_names()}"
        ) from None
    return factory()


def _is_byte_count(value: object) -> bool:
    # bool is an int subclass; True bytes is a config mistake, not a size.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, slots=True, kw_only=True)
class TierPolicyConfig:
    """Everything needed to build one tier's ``TierPolicy``, validated once.

    A quota larger than the budget is allowed (it just never binds).

    Attributes:
        order: name of the order policy, a key of ``ORDER_POLICIES``.
        budget_bytes: the tier's capacity.
        quotas: explicit per-tenant quotas in bytes (stored as a read-only copy).
        default_quota_bytes: the quota of tenants without an explicit one; None for no limit.
        enable_ttl: whether entries' ``ttl_s`` is honoured (blocks expire when idle).

    Raises:
        ValueError: any field is out of range; the message says which and what is accepted.
    """

    order: str = "lru"
    budget_bytes: int
    # Left out of the hash (a mapping is unhashable) but not out of equality.
    quotas: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    default_quota_bytes: int | None = None
    enable_ttl: bool = True

    def __post_init__(self) -> None:
        if self.order not in ORDER_POLICIES:
            raise ValueError(
                f"order={self.order!r} is not a known order policy; "
                f"valid names: {_valid_order_names()}"
            )
        if not _is_byte_count(self.budget_bytes):
            raise ValueError(f"budget_bytes must be an int >= 0, got {self.budget_bytes!r}")
        for tenant, num_bytes in self.quotas.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"quotas keys must be non-empty tenant names, got {tenant!r}")
            if not _is_byte_count(num_bytes):
                raise ValueError(f"quotas[{tenant!r}] must be an int >= 0, got {num_bytes!r}")
        if self.default_quota_bytes is not None and not _is_byte_count(self.default_quota_bytes):
            raise ValueError(
                f"default_quota_bytes must be an int >= 0 or None, got {self.default_quota_bytes!r}"
            )
        if not isinstance(self.enable_ttl, bool):
            raise ValueError(f"enable_ttl must be a bool, got {self.enable_ttl!r}")
        # A frozen config must not change when the caller's dict does.
        object.__setattr__(self, "quotas", MappingProxyType(dict(self.quotas)))


def build_tier_policy(
    config: TierPolicyConfig, *, clock: Callable[[], float] = time.monotonic
) -> TierPolicy:
    """Build a tier's policy stack from its validated config.

    Args:
        config: what to build.
        clock: the time source for TTL expiry (injected so tests can use a fake clock).

    Returns:
        A ``TierPolicy`` tracking nothing. It always has a quota policy (limiting nothing until
        a quota is configured or set at runtime by an operator), and a TTL policy only if
        ``config.enable_ttl``.
    """
    return TierPolicy(
        budget_bytes=config.budget_bytes,
        order=make_order_policy(config.order),
        ttl=TTLPolicy(clock=clock) if config.enable_ttl else None,
        quota=QuotaPolicy(config.quotas, default_bytes=config.default_quota_bytes),
    )
