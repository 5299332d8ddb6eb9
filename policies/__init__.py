"""Eviction and admission rules for cache tiers: LRU, CLOCK, TTL, per-tenant quota, budget."""

from policies.base import (
    BlockKey,
    EvictionPolicy,
    InsertRefused,
    PolicyEntry,
    PolicyError,
    Shortfall,
)
from policies.budget import BudgetPolicy
from policies.clock import ClockPolicy
from policies.lru import LRUPolicy
from policies.quota import QuotaPolicy
from policies.registry import (
    ORDER_POLICIES,
    TierPolicyConfig,
    build_tier_policy,
    make_order_policy,
)
from policies.stack import CanEvict, EvictionResult, Remove, TierPolicy
from policies.ttl import TTLPolicy

__all__ = [
    "ORDER_POLICIES",
    "BlockKey",
    "BudgetPolicy",
    "CanEvict",
    "ClockPolicy",
    "EvictionPolicy",
    "EvictionResult",
    "InsertRefused",
    "LRUPolicy",
    "PolicyEntry",
    "PolicyError",
    "QuotaPolicy",
    "Remove",
    "Shortfall",
    "TTLPolicy",
    "TierPolicy",
    "TierPolicyConfig",
    "build_tier_policy",
    "make_order_policy",
]
