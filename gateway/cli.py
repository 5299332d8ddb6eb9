"""The ``kvgate`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="Prefix-caching gateway for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark and print its figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    index = bench_sub.add_parser("index", help="fingerprint, radix index and eviction figures")
    index.add_argument("--sizes", default="10000,100000,1000000",
                       help="comma-separated index sizes in blocks (default: %(default)s)")
    index.add_argument("--block-tokens", type=int, default=256)
    index.add_argument("--repeats", type=int, default=2000,
                       help="timed lookups per prompt length (default: %(default)s)")
    tiers = bench_sub.add_parser("tiers", help="put/get of a real prefix per tier vs raw limits")
    tiers.add_argument("--model", default="bundled",
                       help="'bundled' (SmolLM2-135M) or a checkpoint directory")
    tiers.add_argument("--data-dir", type=Path, default=Path("data"),
                       help="model conversion cache and scratch files (default: %(default)s)")
    tiers.add_argument("--repeats", type=int, default=5)
    tiers.add_argument("--redis-url", default=None,
                       help="use this Redis instead of starting a redis-server on loopback")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "index":
        from gateway.bench_index import run_index_benchmark

        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        run_index_benchmark(sizes=sizes, block_tokens=args.block_tokens,
                            repeats=args.repeats, out=sys.stdout)
        return 0
    if args.command == "bench" and args.bench == "tiers":
        from gateway.bench_tiers import run_tiers_benchmark

        args.data_dir.mkdir(parents=True, exist_ok=True)
        run_tiers_benchmark(model=args.model, cache_dir=args.data_dir / "models",
                            repeats=args.repeats, out=sys.stdout, redis_url=args.redis_url)
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
