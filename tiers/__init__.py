"""Where KV bytes live (device, host, disk, Redis) and how they move between those tiers."""
