"""Layered host loads (``tiers.layer_arrivals``): a host-tier chain copied into pool pages
layer by layer holds exactly what a whole-block copy holds, whichever slabs its slots sit in.

On a CPU the layered path runs its gathers at once (the indexing the GPU runs); the tests
marked ``gpu`` run it on a stream of its own, with steps waiting per layer (``make test-gpu``).
"""

from __future__ import annotations

import pytest
import torch

from tests.tiers.test_memory import BLOCK_TOKENS, LAYOUT, identical, make_block, make_meta
from tiers.kinds.host import HOST
from tiers.layer_arrivals import LayerArrivals, LayeredLoadsUnavailable, device_view
from tiers.memory import HostStore
from tiers.page_pool import PagePool
from tiers.payload import KVBlock

SLOT_BYTES = LAYOUT.block_nbytes(BLOCK_TOKENS)


def host(*, device: str = "cpu", slots_per_slab: int = 2, budget_blocks: int = 16) -> HostStore:
    """A host tier whose slabs hold ``slots_per_slab`` blocks each, so a chain spans several."""
    return HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK_TOKENS,
                     budget_bytes=budget_blocks * SLOT_BYTES, pin=device == "cuda",
                     serve_device=device, slab_bytes=slots_per_slab * SLOT_BYTES)


def pool_of(*, device: str = "cpu", layered: bool, num_pages: int = 24) -> PagePool:
    pool = PagePool(LAYOUT, page_tokens=BLOCK_TOKENS, num_pages=num_pages, device=device)
    if layered:
        pool.arrivals = LayerArrivals(pool)
    return pool


def read_into(store: HostStore, pool: PagePool, keys: list[int]) -> list[KVBlock | None]:
    pages = [pool.block(pool.allocate(zeroed=False)) for _ in keys]
    return store.get_many([make_meta(k) for k in keys], into=pages)


def on_cpu(block: KVBlock) -> KVBlock:
    return KVBlock(keys=tuple(t.cpu() for t in block.keys),
                   values=tuple(t.cpu() for t in block.values))


def test_a_chain_over_several_slabs_arrives_in_its_pages_as_whole_copies_would_put_it() -> None:
    store = host(slots_per_slab=2)
    blocks = {k: make_block(100 + k) for k in range(7)}
    for k, block in blocks.items():
        store.put(make_meta(k), block)
    chain = [5, 0, 3, 6, 1]  # slots in three slabs, out of order
    layered = read_into(store, pool_of(layered=True), chain)
    whole = read_into(store, pool_of(layered=False), chain)
    for k, by_layer, by_block in zip(chain, layered, whole, strict=True):
        assert by_layer is not None and by_block is not None
        assert identical(by_layer, blocks[k]) and identical(by_layer, by_block)


def test_a_missing_block_leaves_its_place_empty_and_the_others_arrive() -> None:
    store = host()
    for k in (0, 2):
        store.put(make_meta(k), make_block(k))
    got = read_into(store, pool_of(layered=True), [0, 1, 2])
    assert got[1] is None
    assert got[0] is not None and identical(got[0], make_block(0))
    assert got[2] is not None and identical(got[2], make_block(2))


def test_only_the_pages_of_the_chain_are_written() -> None:
    store = host()
    store.put(make_meta(0), make_block(0))
    pool = pool_of(layered=True)
    before = pool.storage.clone()
    page = pool.allocate(zeroed=False)
    store.get_many([make_meta(0)], into=[pool.block(page)])
    bits_differ = pool.storage.view(torch.int32) != before.view(torch.int32)  # NaN-proof
    changed = bits_differ.flatten(4).any(-1).any(0).any(0).any(0)
    assert changed.nonzero().flatten().tolist() == [page.id]


def test_on_a_cpu_nothing_is_left_in_flight_and_a_page_given_back_is_free_at_once() -> None:
    store = host()
    store.put(make_meta(0), make_block(0))
    pool = pool_of(layered=True)
    assert isinstance(pool.arrivals, LayerArrivals)
    got = read_into(store, pool, [0])
    assert not pool.arrivals.is_pending
    free = pool.num_free
    del got
    assert pool.num_free == free + 1


def test_memory_that_is_not_pinned_has_no_device_view() -> None:
    with pytest.raises(LayeredLoadsUnavailable, match="not pinned"):
        device_view(torch.zeros(16, dtype=torch.uint8), torch.device("cuda"))


# ---- on a GPU -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_on_a_gpu_a_chain_arrives_by_layer_with_the_bytes_of_whole_copies() -> None:
    store = host(device="cuda", slots_per_slab=3)
    blocks = {k: make_block(200 + k) for k in range(8)}
    for k, block in blocks.items():
        store.put(make_meta(k), block)
    pool = pool_of(device="cuda", layered=True)
    chain = [7, 2, 4, 0, 5]
    got = read_into(store, pool, chain)
    assert isinstance(pool.arrivals, LayerArrivals) and pool.arrivals.is_pending
    pool.await_all()
    torch.cuda.synchronize()
    assert not pool.arrivals.is_pending
    for k, arrived in zip(chain, got, strict=True):
        assert arrived is not None and identical(on_cpu(arrived), blocks[k])


@pytest.mark.gpu
def test_on_a_gpu_a_read_after_await_layer_sees_that_layer_arrived() -> None:
    store = host(device="cuda", slots_per_slab=64, budget_blocks=256)
    blocks = {k: make_block(300 + k) for k in range(128)}
    for k, block in blocks.items():
        store.put(make_meta(k), block)
    pool = pool_of(device="cuda", layered=True, num_pages=160)
    got = read_into(store, pool, list(blocks))
    for layer in range(LAYOUT.num_layers):
        pool.await_layer(layer)  # the current stream reads only after the copies
        ids = torch.tensor([block.page.id for block in got], device="cuda")  # type: ignore[union-attr]
        keys = pool.storage[layer, 0].index_select(1, ids).cpu()
        for j, k in enumerate(blocks):
            assert torch.equal(keys[:, j], blocks[k].keys[layer])
    pool.await_all()


def one_page_let_go_in_flight(num_pages: int) -> tuple[PagePool, int]:
    """A GPU pool of ``num_pages`` after a one-block host hit whose page was let go before any
    step waited for its copies; and that page's id."""
    store = host(device="cuda")
    store.put(make_meta(0), make_block(0))
    pool = pool_of(device="cuda", layered=True, num_pages=num_pages)
    got = read_into(store, pool, [0])
    page_id = got[0].page.id  # type: ignore[union-attr]
    del got
    return pool, page_id


@pytest.mark.gpu
def test_on_a_gpu_a_page_let_go_in_flight_is_handed_out_only_after_a_wait() -> None:
    pool, page_id = one_page_let_go_in_flight(num_pages=4)
    assert pool.num_free == 3  # parked: a copy may still be writing it
    pool.await_all()
    assert pool.num_free == 4
    assert page_id in [pool.allocate().id for _ in range(pool.num_free)]


@pytest.mark.gpu
def test_on_a_gpu_a_pool_out_of_pages_takes_back_the_parked_ones() -> None:
    pool, page_id = one_page_let_go_in_flight(num_pages=1)
    assert pool.num_free == 0
    assert pool.allocate().id == page_id  # waits for the copies, then hands it out
