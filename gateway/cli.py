"""The ``kvgate`` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "index":
        from gateway.bench_index import run_index_benchmark

        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        run_index_benchmark(sizes=sizes, block_tokens=args.block_tokens,
                            repeats=args.repeats, out=sys.stdout)
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
