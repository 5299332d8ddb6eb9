"""Tier kinds: what each tier is configured with and how it is opened (``base.TierKind``),
one module per kind, gathered in ``registry.TIER_KINDS``."""
