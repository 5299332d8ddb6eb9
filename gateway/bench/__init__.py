"""Benchmarks (index, tiers, ttft, chunks) and their peer runners: rooms of their own, next to
the product, never imported by the modules that serve requests."""
