"""Where a warm start from a lower tier goes: the engine thread's time, per tier and format.

    PYTHONPATH=. .venv/bin/python tools/profile/lower_tier_warm.py [ROW ...] [--tokens N]

ROW: disk, disk:int8, redis or redis:int8 (default: redis:int8). Starts what ``kvgate bench
lossy`` starts (the bundled model on the CPU, a loopback ``redis-server``, an exact and an int8
replica with disk and Redis, each with a second replica that reads Redis only), warms an
N-token prefix (default 2,048), then times 5 rounds of warm requests from each row and from the
device tier (the prefix plus a new 32-token question, max_tokens 1: Usage.ttft_ms, medians,
rows interleaved), and profiles 3 requests of each ROW with cProfile over the engine thread's
turns (the load's reads, decoding and verifying, dequantizing, page fills, and the suffix's
forward), by cumulative and by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from shutil import which

from gateway.bench import lossy
from gateway.bench.numerics import resolve_numerics
from gateway.bench.prompts import SuffixSource, make_prefix
from gateway.bench.spawn import redis_on_loopback
from gateway.core.requests import Usage
from gateway.engine.models.loading import load_model
from gateway.engine.scheduling import loop as engine_loop

ROWS = ("disk", "disk:int8", "redis", "redis:int8")


def replica_of(row: str) -> tuple[str, bool]:
    """The bench replica that serves ``row`` from its tier, and whether the row is lossy."""
    is_lossy = row.endswith(":int8")
    name = "lossy" if is_lossy else "exact"
    return (name + "-b" if row.startswith("redis") else name), is_lossy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", nargs="*", choices=ROWS, default=["redis:int8"])
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    redis_server = which("redis-server")
    if redis_server is None:
        raise SystemExit("no redis-server on PATH")
    with ExitStack() as stack:
        data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-profile-")))
        options = lossy.LossyOptions(model="bundled", data_dir=data, tokens=args.tokens,
                                     redis_binary=redis_server)
        numerics = resolve_numerics()
        # The bundled model's conversion is cached where kvgate serve caches it by default.
        loaded = load_model("bundled", cache_dir=Path("data") / "models",
                            device=numerics.device, dtype=numerics.dtype)
        prefix = make_prefix(loaded, args.tokens, "lossy tiers")
        questions = SuffixSource(loaded, 32)
        url = stack.enter_context(redis_on_loopback(redis_server, data / "redis"))
        replicas = stack.enter_context(lossy.open_replicas(loaded, options, numerics, data, url))
        for name in ("exact", "lossy"):
            replicas[name].generate(prefix, max_tokens=1)
            replicas[name].drop_upper_tiers()

        def warm(row: str) -> Usage:
            if row == "device":
                chosen = replicas["exact"]
                chosen.generate(prefix, max_tokens=1)
                allow_lossy = False
            else:
                name, allow_lossy = replica_of(row)
                chosen = replicas[name]
                chosen.drop_upper_tiers()
            usage = chosen.generate(prefix + questions.next(), max_tokens=1,
                                    allow_lossy=allow_lossy)[1]
            lossy.check_served(usage, row, args.tokens)
            return usage

        timed = ["device", *args.rows]
        samples: dict[str, list[float]] = {row: [] for row in timed}
        for _ in range(5):
            for row in timed:
                samples[row].append(warm(row).ttft_ms)
        for row, values in samples.items():
            print(f"{row:<11} p50 {statistics.median(values):7.1f} ms   "
                  + " ".join(f"{v:.0f}" for v in values))

        turn = engine_loop.StepLoop._turn
        for row in args.rows:
            profiler = cProfile.Profile()

            def profiled_turn(self: engine_loop.StepLoop,
                              profiler: cProfile.Profile = profiler) -> None:
                profiler.enable()
                try:
                    turn(self)
                finally:
                    profiler.disable()

            engine_loop.StepLoop._turn = profiled_turn  # type: ignore[method-assign]
            try:
                for _ in range(3):
                    print(f"{row}: ttft {warm(row).ttft_ms:.1f} ms")
            finally:
                engine_loop.StepLoop._turn = turn  # type: ignore[method-assign]
            print(f"engine thread, 3 warm requests from {row}, by cumulative time:")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
