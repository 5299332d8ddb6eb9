"""Where a warm start from Redis goes: the engine thread's time, exact against int8.

    PYTHONPATH=. .venv/bin/python tools/profile/remote_warm.py [exact|int8|both] [TOKENS]

Starts what ``kvgate bench lossy`` starts (the bundled model on the CPU, a loopback
``redis-server``, an exact and an int8 replica, each with a second replica that reads Redis
only), warms a TOKENS-token prefix (default 2,048), then times 5 rounds of warm requests (the
prefix plus a new 32-token question, max_tokens 1): from the device tier, from Redis exact, from
Redis int8 (Usage.ttft_ms, medians). Then profiles 3 requests of the chosen kind with cProfile
over the engine thread's turns: the Redis round trip, decoding and verifying, dequantizing, the
page fills and the suffix's forward, each by cumulative and by own time.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from shutil import which

from gateway.bench import lossy
from gateway.bench.numerics import resolve_numerics
from gateway.bench.prompts import SuffixSource, make_prefix
from gateway.bench.spawn import redis_on_loopback
from gateway.core.requests import Usage
from gateway.engine import loop as engine_loop
from gateway.engine.model import load_model


def main(argv: list[str]) -> None:
    kind = argv[1] if len(argv) > 1 else "int8"
    num_tokens = int(argv[2]) if len(argv) > 2 else 2048
    redis_server = which("redis-server")
    if kind not in ("exact", "int8", "both") or redis_server is None:
        raise SystemExit(__doc__)
    with ExitStack() as stack:
        data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-profile-")))
        options = lossy.LossyOptions(model="bundled", data_dir=data, tokens=num_tokens,
                                     redis_binary=redis_server)
        numerics = resolve_numerics()
        # The bundled model's conversion is cached where kvgate serve caches it by default.
        loaded = load_model("bundled", cache_dir=Path("data") / "models",
                            device=numerics.device, dtype=numerics.dtype)
        prefix = make_prefix(loaded, num_tokens, "lossy tiers")
        questions = SuffixSource(loaded, 32)
        url = stack.enter_context(redis_on_loopback(redis_server, data / "redis"))
        replicas = stack.enter_context(lossy.open_replicas(loaded, options, numerics, data, url))
        for name in ("exact", "lossy"):
            replicas[name].generate(prefix, max_tokens=1)
            replicas[name].drop_upper_tiers()

        def warm(replica: str, allow_lossy: bool, *, from_device: bool = False) -> Usage:
            chosen = replicas[replica]
            if from_device:
                chosen.generate(prefix, max_tokens=1)
            else:
                chosen.drop_upper_tiers()
            return chosen.generate(prefix + questions.next(), max_tokens=1,
                                   allow_lossy=allow_lossy)[1]

        rows: dict[str, list[float]] = {"device": [], "redis": [], "redis:int8": []}
        for _ in range(5):
            rows["device"].append(warm("exact-b", False, from_device=True).ttft_ms)
            rows["redis"].append(warm("exact-b", False).ttft_ms)
            rows["redis:int8"].append(warm("lossy-b", True).ttft_ms)
        for name, samples in rows.items():
            print(f"{name:<11} p50 {statistics.median(samples):7.1f} ms   "
                  + " ".join(f"{s:.0f}" for s in samples))

        profiled = {"exact": [("exact-b", False)], "int8": [("lossy-b", True)],
                    "both": [("exact-b", False), ("lossy-b", True)]}[kind]
        turn = engine_loop.StepLoop._turn
        for replica, allow_lossy in profiled:
            profiler = cProfile.Profile()

            def profiled_turn(self: engine_loop.StepLoop, profiler: cProfile.Profile = profiler
                              ) -> None:
                profiler.enable()
                try:
                    turn(self)
                finally:
                    profiler.disable()

            for _ in range(3):
                replicas[replica].drop_upper_tiers()
                engine_loop.StepLoop._turn = profiled_turn  # type: ignore[method-assign]
                try:
                    usage = replicas[replica].generate(prefix + questions.next(), max_tokens=1,
                                                       allow_lossy=allow_lossy)[1]
                finally:
                    engine_loop.StepLoop._turn = turn  # type: ignore[method-assign]
                print(f"{replica}: ttft {usage.ttft_ms:.1f} ms, {usage.cached_tokens_by_tier}")
            print(f"engine thread, 3 warm requests from {replica}, by cumulative time:")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main(sys.argv)
