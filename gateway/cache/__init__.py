"""Which blocks exist and where: the radix index, the placement (who holds what), the prefix
cache that decides (leases, refcounts, pins), the transfers that move bytes between tiers, admin
selection, restart adoption, and the factory that builds the cache layer from its config."""
