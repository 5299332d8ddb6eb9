"""What admitting a warm turn costs: its cached prefix listed from the pool, or copied.

A request admitted on a hit builds its block table (``gateway.engine.kv.sequence``): the device
tier's pages are listed, nothing is copied. Before the page pool, every admission copied the
cached prefix into buffers of the request's own; that copy is measured beside it here, in the
same run, as copying the same blocks into pages of the request's own (what a block from a slower
tier still costs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gateway.engine.kv.sequence import KVSequence
from tiers.page_pool import PagePool
from tiers.payload import KVBlock, KVLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionResult:
    """Median seconds to admit one warm turn, each way."""

    cached_tokens: int
    listed_s: float
    copied_s: float

    @property
    def speedup(self) -> float:
        return self.copied_s / self.listed_s if self.listed_s > 0 else float("inf")


def measure_admission(layout: KVLayout, *, cached_tokens: int = 1728, block_tokens: int = 64,
                      new_tokens: int = 128, repeats: int = 30,
                      device: torch.device | str = "cpu",
                      clock: Callable[[], float] = time.perf_counter) -> AdmissionResult:
    """Admit a turn of ``cached_tokens`` (whole blocks) + ``new_tokens`` ``repeats`` times
    each way and take the medians."""
    num_blocks = cached_tokens // block_tokens
    capacity = num_blocks * block_tokens + new_tokens
    pool = PagePool(layout, page_tokens=block_tokens, device=device,
                    num_pages=num_blocks + 2 * -(-capacity // block_tokens))
    generator = torch.Generator().manual_seed(0)
    pages = []
    for _ in range(num_blocks):
        page = pool.allocate()
        shape = (layout.kv_heads, block_tokens, layout.head_dim)
        pool.fill(page, KVBlock(
            keys=tuple(torch.randn(shape, generator=generator).to(layout.dtype)
                       for _ in range(layout.num_layers)),
            values=tuple(torch.randn(shape, generator=generator).to(layout.dtype)
                         for _ in range(layout.num_layers))))
        pages.append(pool.block(page))
    plain = [KVBlock(keys=tuple(t.clone() for t in b.keys),
                     values=tuple(t.clone() for t in b.values)) for b in pages]

    def admit(blocks: list[KVBlock]) -> float:
        began = clock()
        seq = KVSequence.from_blocks(pool, blocks, capacity)
        seq.prepare(1)  # the page its first new token goes into
        took = clock() - began
        seq.release()
        return took

    listed: list[float] = []
    copied: list[float] = []
    for _ in range(repeats):  # side by side: the machine's noise falls on both alike
        listed.append(admit(list(pages)))
        copied.append(admit(plain))
    return AdmissionResult(cached_tokens=num_blocks * block_tokens,
                           listed_s=statistics.median(listed),
                           copied_s=statistics.median(copied))
