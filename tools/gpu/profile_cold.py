"""Where a cold prefill's time goes on the engine's batched forward, on CUDA.

    python3 .gpu-bundle/profile_cold.py MODEL_DIR PROMPT_TOKENS CHUNK_TOKENS

Searches the route as `kvgate serve` does, times a cold prefill of PROMPT_TOKENS random tokens
in chunks of CHUNK_TOKENS (median of 3 after 2 warm-ups), then prints torch.profiler's tables
of one run by GPU time and by CPU time (a forward whose CPU time exceeds its GPU time is bound
by launches).
"""
import sys
import time
from pathlib import Path

import torch

from gateway.engine.forward.batched import SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import load_model
from gateway.engine.parity.route_search import SearchSettings, build_forward, search_route

model, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dev = torch.device("cuda")
loaded = load_model(model, cache_dir=Path("/tmp/kvdata/models"), device=dev, dtype=torch.bfloat16)
t = time.perf_counter(); verdict = search_route(loaded, SearchSettings()); print("search", round(time.perf_counter() - t, 2), "s", verdict)
forward = build_forward(loaded, verdict); print(type(forward).__name__, getattr(forward, "_attention", None))
ids = torch.randint(0, 40000, (n,)).to(dev)
def run():
    seq = KVSequence.alone(loaded.layout, n, device=dev)
    for b in range(0, n, size):
        forward.forward([SequenceRows(sequence=seq, tokens=ids[b:b + size], wants_logits=b + size >= n)])
    torch.cuda.synchronize()
for _ in range(2): run()
ts = []
for _ in range(3):
    t = time.perf_counter(); run(); ts.append(time.perf_counter() - t)
print(f"cold {n} in chunks of {size}: {sorted(ts)[1]*1000:.1f} ms")
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    run()
print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
