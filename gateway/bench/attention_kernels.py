"""One layer's attention on a GPU: the Triton paged kernel beside torch's own SDPA.

Why: the engine's first-token and decode times on CUDA are bounded by its attention (docs/gpu.md).
This times the kernel alone for the shapes the issue's targets name (8k cached tokens, a
40-token suffix, decode at 1 and 32 users), beside torch's scaled_dot_product_attention over
contiguous K/V -- the fastest thing torch offers, which keeps no invariance -- so the ratio
says what the fixed split size and per-row programs cost. One process, one device, the two
measured alternately; medians of CUDA-event timings.

    python -m gateway.bench.attention_kernels --device cuda [--shape 8b] [--repeats 20]
        [--variant POSITIONS,KEYS,WARPS,STAGES ...]

Each ``--variant`` is a kernel of other tile shapes or launch options ("-" keeps a default),
timed in the same run: how the defaults were chosen. The rows are planned once per case, as
the engine plans a step once for all its layers, so the times are the launches'.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from gateway.engine.attention.triton_paged import TilePlan, TritonPagedAttention

SHAPES = {"1b": (32, 8, 64), "8b": (32, 8, 128), "smol": (9, 3, 64)}
"""(query heads, KV heads, head dim) of the checkpoints in docs/gpu.md."""

PAGE_TOKENS = 64


@dataclass(frozen=True)
class Case:
    name: str
    sequences: int
    cached: int
    new: int


CASES = (Case("prefill 8k cold", 1, 0, 8192), Case("suffix 40 over 8k", 1, 8192, 40),
         Case("decode 1 over 8k", 1, 8192, 1), Case("decode 32 x 1 over 8k", 32, 8192, 1),
         Case("prefill 2k cold", 1, 0, 2048))


@dataclass(frozen=True)
class Row:
    case: str
    kernel_ms: dict[str, float]
    sdpa_ms: float


def parse_variant(text: str) -> TritonPagedAttention:
    """A kernel from ``POSITIONS,KEYS,WARPS,STAGES`` ("-": the default of that one)."""
    parts = text.split(",")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"a variant is POSITIONS,KEYS,WARPS,STAGES, got {text!r}")
    try:
        positions, keys, warps, stages = (None if p == "-" else int(p) for p in parts)
        return TritonPagedAttention(tile_positions=positions or 16, tile_keys=keys or 64,
                                    num_warps=warps, num_stages=stages)  # one shape for all
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)))
    return float(statistics.median(times))


def measure(case: Case, shape: tuple[int, int, int], device: torch.device,
            dtype: torch.dtype, repeats: int,
            kernels: dict[str, TritonPagedAttention]) -> Row:
    heads, kv_heads, dim = shape
    length = case.cached + case.new
    pages_per = -(-length // PAGE_TOKENS)
    pool = torch.randn(2, kv_heads, 1 + case.sequences * pages_per, PAGE_TOKENS, dim,
                       device=device, dtype=dtype)
    table = (torch.arange(case.sequences * pages_per, dtype=torch.int32, device=device)
             .view(case.sequences, pages_per) + 1)
    rows = case.sequences * case.new
    queries = torch.randn(rows, heads, dim, device=device, dtype=dtype)
    positions = torch.arange(case.cached, length).repeat(case.sequences)
    row_items = torch.arange(case.sequences).repeat_interleave(case.new)
    kernel_ms = {}
    for name, kernel in kernels.items():
        plan = TilePlan.of(positions, row_items, kernel.shape_for(dim).tile_positions, device)
        kernel_ms[name] = _median_ms(functools.partial(
            kernel.attend_planned, queries, pool[0], pool[1], table, plan), repeats)
    # contiguous K/V per sequence for SDPA, [sequences, kv_heads, length, dim]
    keys = pool[0, :, 1:].reshape(kv_heads, case.sequences, pages_per * PAGE_TOKENS, dim)
    keys = keys[:, :, :length].transpose(0, 1).contiguous()
    values = pool[1, :, 1:].reshape(kv_heads, case.sequences, pages_per * PAGE_TOKENS, dim)
    values = values[:, :, :length].transpose(0, 1).contiguous()
    q = queries.view(case.sequences, case.new, heads, dim).transpose(1, 2)
    mask = None
    if case.new > 1:
        mask = (torch.arange(length, device=device)[None, :]
                <= torch.arange(case.cached, length, device=device)[:, None])
    if case.cached == 0:
        sdpa = lambda: F.scaled_dot_product_attention(q, keys, values, is_causal=True,  # noqa: E731
                                                      enable_gqa=True)
    else:
        sdpa = lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,  # noqa: E731
                                                      enable_gqa=True)
    return Row(case.name, kernel_ms, _median_ms(sdpa, repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.attention_kernels",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variant", action="append", default=[], type=str,
                        help="POSITIONS,KEYS,WARPS,STAGES: another kernel to time beside the "
                             "default ('-' keeps a default); repeatable")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    kernels = {"default": TritonPagedAttention()}
    for text in args.variant:
        try:
            kernels[text] = parse_variant(text)
        except argparse.ArgumentTypeError as exc:
            parser.error(f"--variant: {exc}")
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("this benchmark needs a CUDA device (the kernel is interpreted elsewhere)",
              file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"shape {args.shape} {shape}, {args.dtype}, median of {args.repeats}, ms per launch")
    print(f"{'case':<24}{'sdpa':>8}" + "".join(f"{name:>16}" for name in kernels))
    rows = []
    for case in CASES:
        row = measure(case, shape, device, dtype, args.repeats, kernels)
        rows.append(row)
        print(f"{row.case:<24}{row.sdpa_ms:>8.3f}" + "".join(
            f"{ms:>9.3f} {ms / row.sdpa_ms:>5.1f}x" for ms in row.kernel_ms.values()),
            flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(r) for r in rows], out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
