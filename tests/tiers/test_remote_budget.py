"""The remote writer's per-tenant write budget: a tenant past its bytes per second has the rest
of its chain dropped (counted), its chain's head kept; other tenants and the shared scope are not
touched. The remote here is a real in-memory store (what Redis is to the writer: a BlockStore)."""

from __future__ import annotations

import dataclasses

from policies.rate import TenantRates
from tests.tiers.test_memory import make_block, make_meta
from tiers.base import BlockMeta
from tiers.hierarchy import RemoteWriter
from tiers.memory import DeviceStore
from tiers.payload import KVBlock


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chain(owner: str, first: int, length: int) -> list[tuple[BlockMeta, KVBlock]]:
    return [(dataclasses.replace(make_meta(i), owner=owner), make_block(i))
            for i in range(first, first + length)]


def written(store: DeviceStore, items: list[tuple[BlockMeta, KVBlock]]) -> list[bool]:
    return [store.contains(meta.key) for meta, _ in items]


def test_a_tenant_past_its_budget_keeps_its_chains_head_and_others_are_untouched() -> None:
    block_bytes = make_block(0).nbytes
    clock = FakeClock()
    store = DeviceStore(device="cpu")
    writer = RemoteWriter(store, budget=TenantRates(2 * block_bytes, 2 * block_bytes,
                                                    clock=clock),
                          exempt_owners=frozenset({"shared"}))
    writer.start()
    try:
        flood = chain("tenant-a", 0, 5)
        quiet = chain("tenant-b", 100, 2)
        shared = chain("shared", 200, 4)
        for items in (flood, quiet, shared):
            writer.submit(items)
        assert writer.flush(timeout_s=10)
        assert written(store, flood) == [True, True, False, False, False]
        assert written(store, quiet) == [True, True]
        assert written(store, shared) == [True] * 4
        assert writer.owner_to_num_over_budget == {"tenant-a": 3}
        assert not writer.submit(chain("tenant-a", 10, 1))  # nothing left this second
        clock.now = 1.0  # a second later, two blocks' worth again
        writer.submit(chain("tenant-a", 20, 1))
        assert writer.flush(timeout_s=10)
        assert written(store, chain("tenant-a", 20, 1)) == [True]
    finally:
        writer.close()


def test_a_chain_bigger_than_the_queues_room_has_its_head_written_and_the_rest_dropped() -> None:
    block_bytes = make_block(0).nbytes
    store = DeviceStore(device="cpu")
    writer = RemoteWriter(store, max_pending_bytes=3 * block_bytes)
    writer.start()
    try:
        long_chain = chain("tenant-a", 0, 5)
        assert writer.submit(long_chain)
        assert writer.flush(timeout_s=10)
        assert written(store, long_chain) == [True, True, True, False, False]
        assert writer.num_dropped == 2
    finally:
        writer.close()


def test_a_chain_is_dropped_whole_when_not_even_its_first_block_fits() -> None:
    block_bytes = make_block(0).nbytes
    store = DeviceStore(device="cpu")
    writer = RemoteWriter(store, max_pending_bytes=block_bytes - 1)
    writer.start()
    try:
        assert not writer.submit(chain("tenant-a", 0, 2))
        assert writer.num_dropped == 2
    finally:
        writer.close()
