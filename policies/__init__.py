"""Eviction and admission rules for cache tiers: LRU, CLOCK, TTL, per-tenant quota, budget."""
