"""vLLM's KV pages copied into kvgate's page pool and back, their bytes unchanged.

vLLM's CPU backend keeps each layer's KV as one tensor ``[blocks, kv_heads, block_size,
2 * head_size]`` in which, for every block and head, the first ``block_size * head_size``
numbers are K and the next are V, each half packed for the instruction set its kernels chose
(``page_layout``). kvgate's block is ``[layers, 2, kv_heads, tokens, head_dim]``. So a page is
moved as those two halves, viewed ``[kv_heads, 2, block_size, head_size]``, whole: what kvgate
calls a block's K is the packed K half, meaningful only under the page layout's namespace.

Why a copy into the pool on saving: the disk and Redis writers keep the tensors they are handed
until their thread encodes them, and vLLM reuses its blocks at once -- a block stored must be
kvgate's own memory (docs/vllm-worker.md, "How it works").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gateway.vllm_connector.page_layout import VllmPageLayout
from tiers.page_pool import PagedBlock, PagePool
from tiers.payload import KVBlock


def layer_problems(layers: Sequence[torch.Tensor], layout: VllmPageLayout) -> list[str]:
    """Why ``layers`` (vLLM's KV tensors, in layer order) are not pages of ``layout`` (empty:
    they are), one sentence each."""
    if len(layers) != layout.num_layers:
        return [f"vLLM registered {len(layers)} KV layers; the layout has {layout.num_layers}"]
    want = (layout.kv_heads, layout.block_size, 2 * layout.head_size)
    found = []
    for index, layer in enumerate(layers):
        if tuple(layer.shape[1:]) != want or layer.dtype != layout.dtype:
            found.append(f"layer {index}'s KV is {tuple(layer.shape)} {layer.dtype}, not "
                         f"[blocks, {', '.join(map(str, want))}] {layout.dtype}")
        elif not layer.is_contiguous():
            found.append(f"layer {index}'s KV is not contiguous")
    return found


def halves(layer: torch.Tensor, block_id: int) -> torch.Tensor:
    """Block ``block_id`` of one layer as ``[kv_heads, 2, block_size, head_size]`` (K, then V:
    a view)."""
    _, kv_heads, block_size, width = layer.shape
    return layer[block_id].view(kv_heads, 2, block_size, width // 2)


def save_page(layers: Sequence[torch.Tensor], block_id: int, pool: PagePool) -> PagedBlock:
    """vLLM's block ``block_id`` of every layer, copied into a page of ``pool`` (its block
    size vLLM's): the block kvgate stores.

    Raises:
        PoolExhausted: every page of the pool is held.
    """
    page = pool.allocate(zeroed=False)
    target = pool.storage[:, :, :, page.id]  # [layers, 2, kv_heads, tokens, head_dim]
    for index, layer in enumerate(layers):
        target[index].copy_(halves(layer, block_id).transpose(0, 1))
    return pool.block(page)


def load_page(block: KVBlock, layers: Sequence[torch.Tensor], block_id: int) -> None:
    """A stored block written into vLLM's block ``block_id`` of every layer."""
    for index, layer in enumerate(layers):
        source = (block.packed[index] if block.packed is not None
                  else torch.stack([block.keys[index], block.values[index]]))
        halves(layer, block_id).copy_(source.transpose(0, 1))
