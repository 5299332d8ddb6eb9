"""A vLLM page copied into kvgate's pool and back is the same bytes, and nothing beside it
moves (gateway/vllm_connector/pages.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gateway.vllm_connector.page_layout import VllmPageLayout
from gateway.vllm_connector.pages import halves, layer_problems, load_page, save_page
from tiers.page_pool import PagePool
from tiers.payload import KVBlock

LAYERS, KV_HEADS, BLOCK, HEAD = 3, 2, 32, 16
BLOCKS = 6


def layout(dtype: torch.dtype) -> VllmPageLayout:
    return VllmPageLayout(vllm_version="0.32.0", backend="CPU_ATTN", isa="vec", dtype=dtype,
                          block_size=BLOCK, num_layers=LAYERS, kv_heads=KV_HEADS,
                          head_size=HEAD)


def vllm_layers(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD, generator=generator).to(dtype)
            for _ in range(LAYERS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_page_saved_then_loaded_elsewhere_is_the_same_bytes(dtype: torch.dtype) -> None:
    pool = PagePool(layout(dtype).kv_layout, page_tokens=BLOCK, num_pages=4)
    source, target = vllm_layers(dtype, 0), vllm_layers(dtype, 1)
    before = [layer.clone() for layer in target]
    load_page(save_page(source, 3, pool), target, 5)
    for layer, was, saved in zip(target, before, source, strict=True):
        assert torch.equal(layer[5].view(torch.uint8), saved[3].view(torch.uint8))
        assert torch.equal(layer[:5], was[:5])  # its neighbours untouched


def test_a_saved_blocks_k_is_the_pages_first_half() -> None:
    pool = PagePool(layout(torch.float32).kv_layout, page_tokens=BLOCK, num_pages=2)
    layers = vllm_layers(torch.float32, 2)
    block = save_page(layers, 1, pool)
    page = layers[2][1].reshape(KV_HEADS, 2 * BLOCK * HEAD)
    assert torch.equal(block.keys[2].reshape(KV_HEADS, -1), page[:, :BLOCK * HEAD])
    assert torch.equal(block.values[2].reshape(KV_HEADS, -1), page[:, BLOCK * HEAD:])


def test_a_saved_page_is_the_pools_own_memory() -> None:
    pool = PagePool(layout(torch.float32).kv_layout, page_tokens=BLOCK, num_pages=2)
    layers = vllm_layers(torch.float32, 3)
    block = save_page(layers, 0, pool)
    layers[0].zero_()  # vLLM reuses its block
    assert block.keys[0].abs().sum() > 0
    assert pool.num_in_use == 1


def test_a_block_without_a_packed_tensor_loads_the_same() -> None:
    pool = PagePool(layout(torch.float32).kv_layout, page_tokens=BLOCK, num_pages=2)
    source, target = vllm_layers(torch.float32, 4), vllm_layers(torch.float32, 5)
    saved = save_page(source, 2, pool)
    unpacked = KVBlock(keys=[k.clone() for k in saved.keys],
                       values=[v.clone() for v in saved.values])
    load_page(unpacked, target, 0)
    assert all(torch.equal(t[0], s[2]) for t, s in zip(target, source, strict=True))


def test_halves_split_a_head_into_k_then_v() -> None:
    layer = torch.arange(BLOCKS * KV_HEADS * BLOCK * 2 * HEAD, dtype=torch.float32).view(
        BLOCKS, KV_HEADS, BLOCK, 2 * HEAD)
    k_then_v = halves(layer, 4)
    assert tuple(k_then_v.shape) == (KV_HEADS, 2, BLOCK, HEAD)
    assert k_then_v[1, 1, 0, 0] == layer[4, 1].flatten()[BLOCK * HEAD]


def test_layers_of_another_shape_are_named() -> None:
    want = layout(torch.float32)
    assert layer_problems(vllm_layers(torch.float32, 6), want) == []
    assert "registered 2 KV layers" in layer_problems(vllm_layers(torch.float32, 6)[:2],
                                                      want)[0]
    other = dataclasses.replace(want, head_size=32)
    (problem, *_) = layer_problems(vllm_layers(torch.float32, 6), other)
    assert "layer 0's KV is" in problem
