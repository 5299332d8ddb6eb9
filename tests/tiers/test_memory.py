"""Device and host tiers: bit-identical round trips, pooled slots, counters."""

from __future__ import annotations

import pytest
import torch

from policies.base import BlockKey
from tests.copy_count import CountCopies
from tiers.base import BlockMeta, BlockStore
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore, SlabPool
from tiers.page_pool import PagePool
from tiers.payload import KVBlock, KVLayout

LAYOUT = KVLayout(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float32)
BLOCK_TOKENS = 4


def make_block(seed: int, layout: KVLayout = LAYOUT) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    shape = (layout.kv_heads, BLOCK_TOKENS, layout.head_dim)

    def tensors() -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.randn(shape, generator=g).to(layout.dtype) for _ in range(layout.num_layers)
        )

    return KVBlock(keys=tensors(), values=tensors())


def make_meta(i: int) -> BlockMeta:
    return BlockMeta(
        key=BlockKey(i.to_bytes(16, "little")),
        parent_key=BlockKey(bytes(16)),
        namespace_digest=b"n" * 32,
        owner="alice",
        tokens=bytes(4 * BLOCK_TOKENS),
    )


def identical(a: KVBlock, b: KVBlock) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True)
    )


def host_store(budget_blocks: int = 8, layout: KVLayout = LAYOUT) -> HostStore:
    return HostStore(name=HOST, 
        layout=layout,
        block_tokens=BLOCK_TOKENS,
        budget_bytes=budget_blocks * layout.block_nbytes(BLOCK_TOKENS),
    )


def page_pool(num_pages: int = 8) -> PagePool:
    return PagePool(LAYOUT, page_tokens=BLOCK_TOKENS, num_pages=num_pages)


@pytest.fixture(params=["device", "paged device", "host"])
def store(request: pytest.FixtureRequest) -> BlockStore:
    if request.param == "device":
        return DeviceStore(device="cpu")
    if request.param == "paged device":
        return DeviceStore(pool=page_pool())
    return host_store()


def test_memory_stores_implement_the_block_store_protocol(store: BlockStore) -> None:
    assert isinstance(store, BlockStore)


def test_round_trip_is_bit_identical(store: BlockStore) -> None:
    block = make_block(1)
    store.put(make_meta(1), block)
    got = store.get(make_meta(1))
    assert got is not None and identical(got, block)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_host_round_trip_keeps_half_precision_bits(dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=dtype)
    store = host_store(layout=layout)
    block = make_block(2, layout)
    store.put(make_meta(2), block)
    got = store.get(make_meta(2))
    assert got is not None and identical(got, block)
    assert got.keys[0].dtype == dtype


def test_missing_block_is_a_counted_miss(store: BlockStore) -> None:
    assert store.get(make_meta(9)) is None
    assert store.stats().misses == 1


def test_delete_frees_the_block(store: BlockStore) -> None:
    store.put(make_meta(1), make_block(1))
    store.delete(BlockKey((1).to_bytes(16, "little")))
    assert not store.contains(BlockKey((1).to_bytes(16, "little")))
    assert (store.stats().num_blocks, store.stats().num_bytes) == (0, 0)


def test_batch_calls_default_to_single_calls(store: BlockStore) -> None:
    blocks = [make_block(i) for i in range(3)]
    store.put_many([(make_meta(i), b) for i, b in enumerate(blocks)])
    got = store.get_many([make_meta(i) for i in range(4)])
    assert got[3] is None
    assert all(g is not None and identical(g, b) for g, b in zip(got[:3], blocks, strict=True))


def test_device_store_keeps_blocks_already_on_its_device_without_copying() -> None:
    store = DeviceStore(device="cpu")
    block = make_block(3)
    store.put(make_meta(3), block)
    got = store.get(make_meta(3))
    assert got is not None and got.keys[0].data_ptr() == block.keys[0].data_ptr()


def test_a_paged_device_store_keeps_a_page_handed_to_it_as_it_is() -> None:
    pool = page_pool()
    store = DeviceStore(pool=pool)
    page = pool.allocate()
    pool.fill(page, make_block(3))
    store.put(make_meta(3), pool.block(page))
    got = store.get(make_meta(3))
    assert got is not None and pool.page_of(got) is page
    assert pool.num_in_use == 1


def test_a_paged_device_store_copies_other_blocks_into_pages_of_its_pool() -> None:
    pool = page_pool()
    store = DeviceStore(pool=pool)
    block = make_block(5)
    store.put(make_meta(5), block)
    got = store.get(make_meta(5))
    assert got is not None and pool.page_of(got) is not None and identical(got, block)
    store.delete(make_meta(5).key)
    del got
    assert pool.num_in_use == 0  # the page went back with the block


def test_one_page_stored_under_two_keys_is_two_pages() -> None:
    pool = page_pool()
    store = DeviceStore(pool=pool)
    page = pool.allocate()
    pool.fill(page, make_block(6))
    store.put(make_meta(1), pool.block(page))
    store.put(make_meta(2), pool.block(page))  # a tenant re-storing a shared block
    assert pool.num_in_use == 2  # the budget charges each key for memory of its own


def test_a_paged_device_store_drops_a_put_when_the_pool_is_full_and_counts_it() -> None:
    store = DeviceStore(pool=page_pool(num_pages=1))
    store.put(make_meta(1), make_block(1))
    store.put(make_meta(2), make_block(2))
    assert store.get(make_meta(2)) is None
    assert store.stats().notes["dropped_pool_full"] == 1


def test_a_device_store_without_a_pool_copies_a_page_out() -> None:
    pool = page_pool()
    page = pool.allocate()
    pool.fill(page, make_block(7))
    store = DeviceStore(device="cpu")
    store.put(make_meta(7), pool.block(page))
    del page
    got = store.get(make_meta(7))
    assert got is not None and pool.page_of(got) is None and pool.num_in_use == 0


def test_host_store_copies_blocks_into_its_own_slots() -> None:
    store = host_store()
    block = make_block(4)
    store.put(make_meta(4), block)
    block.keys[0].fill_(0.0)  # the caller's tensors are not the stored ones
    got = store.get(make_meta(4))
    assert got is not None and not torch.all(got.keys[0] == 0.0)


def test_a_host_block_read_into_a_page_is_one_copy_into_it() -> None:
    host = host_store()
    block = make_block(4)
    host.put(make_meta(4), block)
    pool = page_pool()
    page = pool.block(pool.allocate())
    with CountCopies() as copies:
        got = host.get(make_meta(4), into=page)
    assert got is page and identical(got, block)
    assert copies.copies == 1


def test_a_host_chain_read_into_pages_is_one_copy_into_each_and_a_gap_a_counted_miss() -> None:
    host = host_store()
    blocks = {i: make_block(i) for i in (1, 3)}
    for i, block in blocks.items():
        host.put(make_meta(i), block)
    pool = page_pool()
    pages = [pool.block(pool.allocate()) for _ in range(3)]
    with CountCopies() as copies:
        got = host.get_many([make_meta(1), make_meta(2), make_meta(3)], into=pages)
    assert got[0] is pages[0] and identical(pages[0], blocks[1])
    assert got[1] is None
    assert got[2] is pages[2] and identical(pages[2], blocks[3])
    assert copies.copies == 2
    stats = host.stats()
    assert (stats.hits, stats.misses) == (2, 1)


def test_a_host_chain_read_without_pages_is_a_copy_of_each_block() -> None:
    host = host_store()
    block = make_block(5)
    host.put(make_meta(5), block)
    [got] = host.get_many([make_meta(5)])
    assert got is not None and identical(got, block)
    got.keys[0].fill_(0.0)  # the copy is the reader's own
    again = host.get(make_meta(5))
    assert again is not None and identical(again, block)


def test_host_store_reuses_freed_slots_instead_of_allocating() -> None:
    store = host_store(budget_blocks=2)
    for i in range(10):
        store.put(make_meta(i), make_block(i))
        store.delete(make_meta(i).key)
    assert store.stats().notes["pool_bytes"] == 2 * LAYOUT.block_nbytes(BLOCK_TOKENS)


def test_host_store_drops_puts_beyond_its_pool_and_counts_them() -> None:
    store = host_store(budget_blocks=2)
    for i in range(3):
        store.put(make_meta(i), make_block(i))
    assert store.stats().num_blocks == 2
    assert store.stats().notes["dropped_pool_full"] == 1


def test_slab_pool_carves_slots_from_slabs() -> None:
    pool = SlabPool(slot_bytes=100, max_slots=5, slab_bytes=250)
    slots = [pool.take() for _ in range(6)]
    assert slots[-1] is None
    assert pool.num_allocated_bytes == 500
    assert all(s is not None and s.numel() == 100 for s in slots[:5])


def test_host_store_is_not_pinned_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinned by default")
    assert not host_store().is_pinned


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_tier_serves_straight_to_the_gpu() -> None:
    host = host_store()
    assert host.is_pinned
    block = make_block(5)
    host.put(make_meta(5), block)
    got = host.get(make_meta(5))
    assert got is not None and got.keys[0].is_cuda
    torch.cuda.synchronize()
    assert identical(KVBlock(keys=tuple(t.cpu() for t in got.keys),
                             values=tuple(t.cpu() for t in got.values)), block)


def test_a_host_block_stays_valid_after_its_slot_is_reused() -> None:
    store = host_store(budget_blocks=1)
    first = make_block(6)
    store.put(make_meta(6), first)
    got = store.get(make_meta(6))
    store.delete(make_meta(6).key)
    store.put(make_meta(7), make_block(7))  # reuses the only slot
    assert got is not None and identical(got, first)


def test_a_page_moves_to_the_host_tier_and_back_in_one_copy_each_way() -> None:
    """Pages and host slots are packed blocks: a demotion and a load are one copy each (on a
    GPU, one launch each instead of one per layer and kind), bit for bit."""
    pool, host = page_pool(), host_store()
    page = pool.allocate()
    pool.fill(page, make_block(5))
    paged = pool.block(page)
    with CountCopies() as put:
        host.put(make_meta(1), paged)
    with CountCopies() as got:
        loaded = host.get(make_meta(1))
    assert put.copies == 1 and got.copies == 1
    assert loaded is not None and loaded.packed is not None
    assert identical(loaded, make_block(5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_block_and_a_page_count_the_bytes_of_their_keys_and_values(
        dtype: torch.dtype) -> None:
    layout = KVLayout(num_layers=3, kv_heads=2, head_dim=8, dtype=dtype)
    separate = make_block(7, layout)
    packed = KVBlock.of_packed(torch.stack([torch.stack([k, v]) for k, v in
                                            zip(separate.keys, separate.values, strict=True)]))
    pool = PagePool(layout, page_tokens=BLOCK_TOKENS, num_pages=3)
    page = pool.allocate()
    pool.fill(page, separate)
    expected = sum(t.numel() * t.element_size() for t in (*separate.keys, *separate.values))
    assert separate.nbytes == packed.nbytes == pool.block(page).nbytes == expected
