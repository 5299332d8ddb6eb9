"""Which blocks exist and where: the radix index, the prefix cache that decides (leases,
refcounts, policies), the transfers that move bytes between tiers, admin selection, restart
adoption, and the factory that builds the stores from the config."""
