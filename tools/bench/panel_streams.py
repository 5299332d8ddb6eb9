"""How fast the panel kernel streams a whole model's weights at a few rows, beside another
checkout's kernel in the same run (issue 45: a decode step reads every weight once).

    python tools/bench/panel_streams.py --baseline DIR [--coding bfloat16|float32]
        [--rows 1,2,4,8,16,32] [--passes 5] [--portable-width]

The weights are SmolLM2's shape (30 layers of q|k|v 960 x 576, o 576 x 576, gate|up 3,072 x 576,
down 576 x 1,536): 212 MB as bfloat16s, 425 MB as float32 -- far more than any cache, so each
pass reads them from memory, as a decode step does. Each row count times both kernels in
alternating passes (the machine's noise falls on both) and prints ms a pass, the bytes a second
and the ratio. ``--portable-width``: both kernels' AVX2 build (what an AVX2-only CPU runs) on a
CPU with AVX-512. The two kernels' outputs are compared bit for bit first: only the speed may
differ.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gateway.engine.linear import panel_products
from gateway.engine.linear.panel_products import PanelKernel, Panels
from gateway.engine.native.build import load

SHAPES = ((576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536))
LAYERS = 30


def weights(coding: str) -> list[Panels]:
    """A model's projections in panels: bfloat16 numbers (kept as bfloat16s) or random float32s
    (kept whole)."""
    generator = torch.Generator().manual_seed(0)
    laid_out = []
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            weight = torch.randn(out_features, in_features, generator=generator) * 0.05
            if coding == "bfloat16":
                weight = weight.to(torch.bfloat16).float()
            laid_out.append(Panels.of(weight))
    return laid_out


def one_pass(kernel: PanelKernel, panels: list[Panels], rows: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for weight in panels:
        kernel(rows[weight.shape[1]], weight)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, required=True,
                        help="a checkout of another kvgate commit (its panel_products.c)")
    parser.add_argument("--coding", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--portable-width", action="store_true")
    args = parser.parse_args()
    wide = not args.portable_width
    source = args.baseline / "gateway" / "engine" / "linear" / "native" / "panel_products.c"
    kernels = {"this": PanelKernel(load(panel_products.SOURCE, wide_vectors=wide)),
               "baseline": PanelKernel(load(source.resolve(), wide_vectors=wide))}
    panels = weights(args.coding)
    megabytes = sum(weight.nbytes for weight in panels) / 1e6
    print(f"{len(panels)} weights, {args.coding}: {megabytes:,.0f} MB a pass; "
          f"{torch.get_num_threads()} threads; {'AVX-512' if wide else 'AVX2'} paths where "
          "the CPU has them")
    print(f"{'rows':>5} {'this ms':>8} {'GB/s':>6} {'baseline ms':>12} {'GB/s':>6} {'ratio':>6}")
    for count in (int(part) for part in args.rows.split(",")):
        generator = torch.Generator().manual_seed(count)
        rows = {k: torch.randn(count, k, generator=generator) for k in {s[1] for s in SHAPES}}
        for weight in panels[:len(SHAPES)]:  # the same bits from both, or no figures
            product = kernels["this"](rows[weight.shape[1]], weight)
            if not torch.equal(product, kernels["baseline"](rows[weight.shape[1]], weight)):
                raise SystemExit(f"the kernels' products differ at {count} rows")
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for kernel in kernels.values():  # warm: built, loaded, pages touched
            one_pass(kernel, panels, rows)
        for _ in range(args.passes):
            for name, kernel in kernels.items():
                times[name].append(one_pass(kernel, panels, rows))
        this, base = (sorted(times[name])[len(times[name]) // 2] for name in kernels)
        print(f"{count:>5} {this * 1e3:>8.2f} {megabytes / 1e3 / this:>6.1f} "
              f"{base * 1e3:>12.2f} {megabytes / 1e3 / base:>6.1f} {this / base:>6.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
