"""Where a warm start's time goes beyond its suffix's forward: the engine in this process.

    python3 .gpu-bundle/profile_warm.py MODEL_DIR PREFIX_TOKENS [SUFFIX_TOKENS] [DEVICE] [TIER]

On the H200 (2026-11-26, docs/gpu.md) a warm start from the device tier cost 10-18 ms more
than transformers' suffix-only forward over a ready cache, at 2k more than kvgate's own cold
start: a fixed cost of the warm path, not of attention. This starts an engine over a cache with
a device tier only (as `kvgate serve` builds both, model and pages on DEVICE, default cuda),
warms a random prefix, and times, medians of 9 after 3 warm-ups:
  - warm: Generate of prefix + a new suffix, max_tokens 1 (the usage's own ttft_ms), served
    from TIER: "device" (default), or "host" (the cache then has a host tier, pinned on CUDA,
    and the device tier's copies are evicted down to it before each request), or
    "host-layered" (the same, with ``[cache] layered_host_loads``: the copy beside the step);
  - cold: the same with no_cache;
  - suffix forward: the engine's batched forward of the suffix over a sequence already
    holding the prefix (what a warm start cannot do without);
then profiles one warm request: cProfile of the engine thread's turn (Python: lookup, lease,
tables, sampling) and, on CUDA, torch.profiler's table by CPU time. Runs on a CPU too
(DEVICE cpu), where the test model's warm path is measured the same way.
"""

from __future__ import annotations

import cProfile
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from gateway.cache.operations.factory import CacheConfig, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, Usage
from gateway.engine.engine import Engine
from gateway.engine.forward.batched import SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import load_model
from gateway.engine.scheduling import loop as engine_loop
from gateway.engine.settings import EngineConfig, EngineSettings

SECRET = b"profile-warm-secret-of-32-bytes!"
SCOPE = Scope.of_tenant("profile")


def main(argv: list[str]) -> None:
    model_dir, num_prefix = argv[1], int(argv[2])
    num_suffix = int(argv[3]) if len(argv) > 3 else 40
    device = torch.device(argv[4] if len(argv) > 4 else "cuda")
    tier = argv[5] if len(argv) > 5 else "device"
    if tier not in ("device", "host", "host-layered"):
        raise SystemExit(f"TIER must be device, host or host-layered, got {tier!r}")
    layered = tier == "host-layered"
    tier = "host" if layered else tier
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    workdir = Path(tempfile.mkdtemp(prefix="profile-warm-"))
    loaded = load_model(model_dir, cache_dir=workdir / "models", device=device, dtype=dtype)
    block_tokens = 64
    prefix_bytes = loaded.layout.block_nbytes(block_tokens) * (num_prefix // block_tokens + 2)
    opened = open_cache(CacheConfig(block_tokens=block_tokens, device_bytes=2 * prefix_bytes,
                                    host_bytes=2 * prefix_bytes if tier == "host" else 0,
                                    layered_host_loads=layered),
                        layout=loaded.layout, deployment_secret=SECRET, device=device,
                        running_bytes=4 * prefix_bytes)
    config = EngineConfig.of(EngineSettings(), block_tokens=block_tokens, max_deadline_s=600.0,
                             device_type=device.type)
    engine = Engine(loaded=loaded, cache=opened.cache, config=config, deployment_secret=SECRET,
                    pool=opened.pool)
    began = time.perf_counter()
    engine.start()
    print(f"engine on {device} ({engine.route.name}: {engine.route.reason}) started in "
          f"{time.perf_counter() - began:.1f} s", flush=True)
    if layered:  # off with a warning where the device cannot read pinned memory in place
        print(f"layered host loads: {opened.pool is not None and opened.pool.arrivals is not None}")
    rng = random.Random(0)
    vocab = min(int(loaded.tokenizer.vocab_size), 30000)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    prefix = tokens(num_prefix)

    def generate(ids: list[int], *, no_cache: bool = False) -> tuple[float, Usage]:
        if tier == "host" and not no_cache:
            opened.cache.evict("device", 1 << 62)  # every device copy down to host
        t0 = time.perf_counter()
        handle = engine.generate(GenerateRequest(
            prompt=PromptInput(token_ids=tuple(ids)), scope=SCOPE,
            sampling=SamplingParams(max_tokens=1), cache=CacheOptions(no_cache=no_cache)))
        usage = [event for event in handle if isinstance(event, Usage)][-1]
        return (time.perf_counter() - t0) * 1e3, usage

    def suffix_forward() -> float:
        seq = KVSequence.alone(loaded.layout, num_prefix + num_suffix, device=device)
        ids = torch.tensor(prefix + tokens(num_suffix), device=device)
        loop = engine._loop  # the engine's own forward (a diagnostic may look inside)
        assert loop is not None
        forward = loop.forward
        forward.forward([SequenceRows(sequence=seq, tokens=ids[:num_prefix], wants_logits=False)])
        sync()
        t0 = time.perf_counter()
        logits = forward.forward([SequenceRows(sequence=seq, tokens=ids[num_prefix:],
                                               wants_logits=True)])
        int(logits[0].argmax())  # the first token, as a request samples it
        return (time.perf_counter() - t0) * 1e3

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    generate(prefix + tokens(num_suffix))  # warms the prefix
    for _ in range(3):
        generate(prefix + tokens(num_suffix))
        generate(prefix + tokens(num_suffix), no_cache=True)
        suffix_forward()
    warm = [generate(prefix + tokens(num_suffix)) for _ in range(9)]
    cold = [generate(prefix + tokens(num_suffix), no_cache=True) for _ in range(9)]
    bare = [suffix_forward() for _ in range(9)]
    print(f"{num_prefix} cached + {num_suffix} new tokens on {device}, medians of 9 (ms):")
    print(f"  warm (client / usage.ttft_ms)   {statistics.median(w for w, _ in warm):8.2f} / "
          f"{statistics.median(u.ttft_ms for _, u in warm):8.2f}   served from "
          f"{warm[-1][1].cached_tokens_by_tier}")
    print(f"  cold (client / usage.ttft_ms)   {statistics.median(c for c, _ in cold):8.2f} / "
          f"{statistics.median(u.ttft_ms for _, u in cold):8.2f}")
    print(f"  suffix forward alone            {statistics.median(bare):8.2f}")

    profiler = cProfile.Profile()
    turn = engine_loop.StepLoop._turn

    def profiled_turn(self: engine_loop.StepLoop) -> None:
        profiler.enable()
        try:
            turn(self)
        finally:
            profiler.disable()

    engine_loop.StepLoop._turn = profiled_turn  # type: ignore[method-assign]
    try:
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    generate(prefix + tokens(num_suffix))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20,
                                            max_name_column_width=60))
        else:
            for _ in range(3):
                generate(prefix + tokens(num_suffix))
    finally:
        engine_loop.StepLoop._turn = turn  # type: ignore[method-assign]
    print("engine thread, 3 warm requests, by cumulative time:")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
    engine.stop(grace_s=5)
    opened.close()


if __name__ == "__main__":
    main(sys.argv)
