"""A page's block: its layer views are made on first use and are views of the pool's page."""

from __future__ import annotations

import torch

from tiers.page_pool import LayerViews, Page, PagePool
from tiers.payload import KVLayout

LAYOUT = KVLayout(num_layers=3, kv_heads=2, head_dim=4, dtype=torch.float32)


def pool_with_one_page() -> tuple[PagePool, Page]:
    pool = PagePool(LAYOUT, page_tokens=5, num_pages=2)
    return pool, pool.allocate()


def test_a_page_block_makes_no_layer_view_until_one_is_read() -> None:
    pool, page = pool_with_one_page()
    block = pool.block(page)
    assert isinstance(block.keys, LayerViews) and block.keys._views is None
    assert block.num_tokens == 5 and block.nbytes == LAYOUT.block_nbytes(5)
    assert block.keys._views is None  # its size and token count come from the packed page


def test_each_layer_view_is_the_page_in_the_pool_for_that_layer_and_kind() -> None:
    pool, page = pool_with_one_page()
    block = pool.block(page)
    assert block.packed is not None
    block.packed.copy_(torch.arange(block.packed.numel(), dtype=torch.float32)
                       .view_as(block.packed))
    assert len(block.keys) == len(block.values) == LAYOUT.num_layers
    for layer in range(LAYOUT.num_layers):
        for kind, views in ((0, block.keys), (1, block.values)):
            in_pool = pool.storage[layer, kind, :, page.id]
            assert torch.equal(views[layer], in_pool)
            assert views[layer].data_ptr() == in_pool.data_ptr()
    assert [t.shape for t in (*block.keys, *block.values)] == [(2, 5, 4)] * 6


def test_a_layer_view_is_made_once_and_slices_read_the_same_views() -> None:
    pool, page = pool_with_one_page()
    block = pool.block(page)
    first = block.keys[1]
    assert block.keys[1] is first and block.keys[1:][0] is first
