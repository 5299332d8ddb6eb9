"""The paged attention kernel on a chat's shapes, beside another checkout's kernel in the same
run (issue 45): a warm turn's prefill and decode steps of users sharing a system prompt.

    python tools/bench/paged_rows.py --baseline DIR [--kv-heads 3] [--rep 3] [--head-dim 64]

One layer's call, SmolLM2's heads by default (3 KV heads of 64, 3 query heads each), 64-token
pages: a 150-token prefill after 1,600 cached tokens, and decode steps of 4 and 8 users whose
tables begin with the same 25 pages (the system prompt) and end in pages of their own. Both
kernels' outputs are compared bit for bit first; each case then times ten calls a sample,
alternating the kernels, and prints the medians of seven samples and their ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gateway.engine.attention import paged
from gateway.engine.attention.paged import PagedKernel
from gateway.engine.native.build import load

PAGE = 64
SHARED_PAGES = 25
PAGES = 40


def case(generator: torch.Generator, *, rows_per_item: int, items: int, start: int,
         heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Block tables (the first SHARED_PAGES shared), each row's item and position, queries."""
    tables = torch.stack([torch.randperm(PAGES, generator=generator)[:32]
                          for _ in range(items)])
    tables[:, :SHARED_PAGES] = tables[0, :SHARED_PAGES].clone()
    row_item = torch.repeat_interleave(torch.arange(items), rows_per_item)
    positions = torch.cat([torch.arange(start, start + rows_per_item) for _ in range(items)])
    queries = torch.randn(len(positions), heads, head_dim, generator=generator)
    return tables, row_item, positions, queries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="a checkout of another kvgate commit (its paged_attention.c)")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--rep", type=int, default=3, help="query heads a KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    source = args.baseline / "gateway" / "engine" / "attention" / "native" / "paged_attention.c"
    kernels = {"this": PagedKernel(load(paged.SOURCE, wide_vectors=True)),
               "baseline": PagedKernel(load(source.resolve(), wide_vectors=True))}
    generator = torch.Generator().manual_seed(0)
    shape = (args.kv_heads, PAGES, PAGE, args.head_dim)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape,
                                                                        generator=generator)
    heads = args.kv_heads * args.rep
    cases = {"prefill of 150 rows after 1,600 cached": (150, 1, 1600),
             "decode of 4 users at 1,750": (1, 4, 1750),
             "decode of 8 users at 1,750": (1, 8, 1750)}
    print(f"one layer: {args.kv_heads} KV heads x {args.rep} query heads of {args.head_dim}, "
          f"{PAGE}-token pages; {torch.get_num_threads()} threads")
    for name, (rows_per_item, items, start) in cases.items():
        tables, row_item, positions, queries = case(
            generator, rows_per_item=rows_per_item, items=items, start=start, heads=heads,
            head_dim=args.head_dim)
        outs = {}
        for label, kernel in kernels.items():
            outs[label] = torch.empty_like(queries)
            kernel(keys, values, tables, queries, row_item, positions, outs[label])
        if not torch.equal(outs["this"], outs["baseline"]):
            raise SystemExit(f"the kernels' outputs differ: {name}")
        samples: dict[str, list[float]] = {label: [] for label in kernels}
        for _ in range(7):
            for label, kernel in kernels.items():
                started = time.perf_counter()
                for _ in range(10):
                    kernel(keys, values, tables, queries, row_item, positions, outs[label])
                samples[label].append((time.perf_counter() - started) / 10)
        this, base = (sorted(samples[label])[3] * 1e3 for label in kernels)
        print(f"{name}: {this:.3f} ms against {base:.3f} ms, {this / base:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
