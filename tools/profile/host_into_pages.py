"""A host-tier hit promoted into the device tier's pages: through a buffer of the block's own
(``HostStore.get``, then ``DeviceStore.put`` copying it into a page) against straight into a
free page (``HostStore.get(into=)``, the page kept as it is), timed side by side in one
process: 32 blocks of SmolLM2-135M's shape (a 2k-token chain, 2.9 MB a block, float32).

Run from the repository: ``PYTHONPATH=. .venv/bin/python tools/profile/host_into_pages.py``.
"""

from __future__ import annotations

import statistics
import time

import torch

from tests.tiers.conftest import seeded_block_meta
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore
from tiers.page_pool import PagePool
from tiers.payload import KVBlock, KVLayout

LAYOUT = KVLayout(num_layers=30, kv_heads=3, head_dim=64, dtype=torch.float32)
BLOCK_TOKENS = 64
NUM_BLOCKS = 32
REPEATS = 7


def main() -> None:
    host = HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK_TOKENS,
                     budget_bytes=(NUM_BLOCKS + 2) * LAYOUT.block_nbytes(BLOCK_TOKENS))
    metas = [seeded_block_meta(i, block_tokens=BLOCK_TOKENS) for i in range(NUM_BLOCKS)]
    for meta in metas:
        host.put(meta, KVBlock.of_packed(torch.randn(30, 2, 3, BLOCK_TOKENS, 64)))
    pool = PagePool(LAYOUT, page_tokens=BLOCK_TOKENS, num_pages=4 * NUM_BLOCKS)

    def through_a_buffer() -> DeviceStore:
        device = DeviceStore(device="cpu", pool=pool)
        for meta in metas:
            block = host.get(meta)
            assert block is not None
            device.put(meta, block)
        return device

    def into_a_page() -> DeviceStore:
        device = DeviceStore(device="cpu", pool=pool)
        for meta in metas:
            block = host.get(meta, into=pool.block(pool.allocate(zeroed=False)))
            assert block is not None
            device.put(meta, block)
        return device

    samples: dict[str, list[float]] = {"through a buffer": [], "into a page": []}
    for _ in range(REPEATS):
        for name, run in (("through a buffer", through_a_buffer), ("into a page", into_a_page)):
            start = time.perf_counter()
            kept = run()
            samples[name].append(time.perf_counter() - start)
            del kept  # its pages go back to the pool
    for name, values in samples.items():
        print(f"{name}: {statistics.median(values) * 1e3:.1f} ms (median of {REPEATS}) for "
              f"{NUM_BLOCKS} blocks of {LAYOUT.block_nbytes(BLOCK_TOKENS) >> 10} KiB")


if __name__ == "__main__":
    main()
