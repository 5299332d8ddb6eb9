"""Memory per tracked block: the order policies hold one node per block of a tier, so a
``__dict__`` or an extra object per node would show up here (the index's own target is 512 B
per block; an order policy should take a fraction of that)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable

import pytest

from policies import BlockKey, ClockPolicy, EvictionPolicy, LRUPolicy, PolicyEntry

NUM_ENTRIES = 20_000
MAX_BYTES_PER_ENTRY = 200  # measured on CPython 3.11: about 110 B (LRU) and 100 B (CLOCK)


@pytest.mark.parametrize("make", [LRUPolicy, ClockPolicy], ids=["lru", "clock"])
def test_an_order_policy_costs_under_200_bytes_per_block(
    make: Callable[[], EvictionPolicy],
) -> None:
    tenants = [f"tenant-{i}" for i in range(8)]
    entries = [
        PolicyEntry(key=BlockKey(n.to_bytes(16, "big")), tenant=tenants[n % 8], num_bytes=4096)
        for n in range(NUM_ENTRIES)
    ]
    gc.collect()
    tracemalloc.start()
    try:
        policy = make()
        for e in entries:
            policy.on_insert(e)
        for e in entries[::2]:
            policy.on_access(e.key)
        num_bytes, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert num_bytes / NUM_ENTRIES < MAX_BYTES_PER_ENTRY
