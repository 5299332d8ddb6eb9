"""Another source of the paged attention kernel against this checkout's: the same bits? how fast?

    git show COMMIT:gateway/engine/attention/native/paged_attention.c > /tmp/other.c
    python tools/native/compare_kernels.py /tmp/other.c [--cases 60] [--repeats 100]

Why: the kernel's numbers are part of the block namespace (``paged_attention.NUMERICS``). A
change made for speed must keep every bit, or cached blocks computed by the old kernel would be
served beside the new one's; this checks it on random shapes (head sizes 8 to 128, pages of 16
and 64, several sequences, rows anywhere) with both sources built with this machine's flags
(AVX-512's included where it has them; this source without them too) and with the portable
ones, then times both, alternated in one process, on the shapes of the bundled model's steps
(minimum over 5 alternations of the median of ``--repeats`` calls).
Exits 1 if any output differs.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gateway.engine.attention.paged import SOURCE as PAGED_SOURCE
from gateway.engine.attention.paged import PagedKernel
from gateway.engine.native.build import (
    BASE_FLAGS,
    INCLUDE_FLAGS,
    compiler,
    cpu_flags,
    isa_flags,
)

TIMED = (("a 40-token suffix over 2,048 cached", [(2048, 40)]),
         ("a decode step of 8 x 1,500", [(1500 + i, 1) for i in range(8)]),
         ("a 256-token prefill chunk at 1,024", [(1024, 256)]))
"""(what, [(first position, rows)] per sequence), SmolLM2's heads: 3 KV heads x 3, 64 wide."""


def build(source: Path, out: Path, *, portable: bool, wide_vectors: bool = True) -> PagedKernel:
    flags = (BASE_FLAGS if portable
             else (*BASE_FLAGS, *isa_flags(cpu_flags(), wide_vectors=wide_vectors)))
    subprocess.run([compiler(), *flags, *INCLUDE_FLAGS, str(source), "-o", str(out), "-lm"],
                   check=True)
    return PagedKernel(ctypes.CDLL(str(out)))


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A call's arguments: K pages, V pages, tables, queries, each row's sequence and position."""


def case(kv_heads: int, rep: int, dim: int, page: int, seqs: list[tuple[int, int]],
         seed: int) -> Case:
    """Pages, tables and queries for rows at positions ``first..first+rows-1`` of each
    sequence."""
    g = torch.Generator().manual_seed(seed)
    num_pages = 1 + sum(-(-(first + rows) // page) for first, rows in seqs)
    keys = torch.randn(kv_heads, num_pages, page, dim, generator=g) * 2
    values = torch.randn(kv_heads, num_pages, page, dim, generator=g)
    tables: list[list[int]] = []
    items: list[int] = []
    positions: list[int] = []
    next_page = 1
    for i, (first, rows) in enumerate(seqs):
        count = -(-(first + rows) // page)
        tables.append(list(range(next_page, next_page + count)))
        next_page += count
        items += [i] * rows
        positions += range(first, first + rows)
    table = torch.zeros(len(seqs), max(map(len, tables)), dtype=torch.int64)
    for i, ids in enumerate(tables):
        table[i, :len(ids)] = torch.tensor(ids)
    queries = torch.randn(len(items), kv_heads * rep, dim, generator=g)
    return (keys, values, table, queries, torch.tensor(items, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64))


def run(kernel: PagedKernel, arguments: Case) -> torch.Tensor:
    out = torch.empty_like(arguments[3])
    kernel(*arguments, out)
    return out


def median_ms(kernel: PagedKernel, arguments: Case, repeats: int) -> float:
    run(kernel, arguments)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run(kernel, arguments)
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("other", type=Path, help="the other kernel source (a .c file)")
    parser.add_argument("--cases", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    here = PAGED_SOURCE
    with tempfile.TemporaryDirectory() as tmp:
        other, mine = (build(args.other, Path(tmp) / "other.so", portable=False),
                       build(here, Path(tmp) / "this.so", portable=False))
        portables = [build(source, Path(tmp) / f"{name}-portable.so", portable=True)
                     for name, source in (("other", args.other), ("this", here))]
        narrow = build(here, Path(tmp) / "this-narrow.so", portable=False, wide_vectors=False)
        rng = random.Random(1)
        differing = 0
        for seed in range(args.cases):
            kv_heads, rep = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 4])
            dim, page = rng.choice([8, 16, 32, 64, 72, 128]), rng.choice([16, 64])
            seqs = [(rng.randrange(0, 300), rng.randrange(1, 12))
                    for _ in range(rng.randrange(1, 5))]
            arguments = case(kv_heads, rep, dim, page, seqs, seed)
            expected = run(other, arguments)
            for kernel in (mine, narrow, *portables):
                if not torch.equal(run(kernel, arguments), expected):
                    differing += 1
                    print(f"DIFFERENT: kv_heads {kv_heads}, rep {rep}, head_dim {dim}, "
                          f"page {page}, sequences {seqs}")
        print(f"{args.cases} random cases, this source (AVX-512 where the CPU has it, and not), "
              f"and both portable builds against "
              f"{args.other}: {'same bits' if not differing else f'{differing} differ'}")
        for what, seqs in TIMED:
            arguments = case(3, 3, 64, 64, seqs, 7)
            others, mines = [], []
            for _ in range(5):
                others.append(median_ms(other, arguments, args.repeats))
                mines.append(median_ms(mine, arguments, args.repeats))
            print(f"{what}: {args.other.name} {min(others):.2f} ms, this {min(mines):.2f} ms "
                  f"({min(mines) / min(others):.2f}x)")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
