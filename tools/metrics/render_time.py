"""How long one ``/metrics`` render takes with the registry populated (docs/operations.md).

Run: ``.venv/bin/python tools/metrics/render_time.py`` -- prints the median and p95 of 200
renders of each registry after 10 000 requests of 50 tenants over 3 tiers: the API port's by
``prometheus_client.generate_latest`` and by the renderer it serves
(``gateway.service.http.text_exposition``), the metrics port's by the library (it serves that).
"""

from __future__ import annotations

import statistics
import time

from prometheus_client import generate_latest

from gateway.service.http.text_exposition import TextExposition
from gateway.service.metrics import GatewayMetrics


def main() -> None:
    metrics = GatewayMetrics(device="cpu", dtype="float32", kv_budget_bytes=1 << 30)
    for i in range(10_000):
        metrics.record_generation(
            tenant=f"t{i % 50}", prompt_tokens=512,
            cached_tokens_by_tier={"device": 256, "host": 64, "disk": 64},
            finish_reason=("length", "eos", "stop")[i % 3], ttft_s=0.05 * (i % 7),
            total_s=0.5, completion_tokens=64)
        metrics.record_queue_wait(0.01 * (i % 5))
        for _ in range(5):
            metrics.record_step(num_requests=1 + i % 16, num_tokens=1 + i % 1024)
            metrics.record_inter_token(0.001 * (i % 50))
    public = TextExposition(metrics.public_registry)
    for name, render in (
            ("API port (no tenants), library", lambda: generate_latest(metrics.public_registry)),
            ("API port (no tenants), served", public.render),
            ("metrics port (50 tenants), library", lambda: generate_latest(metrics.registry))):
        timings = []
        for _ in range(200):
            began = time.perf_counter()
            body = render()
            timings.append(time.perf_counter() - began)
        print(f"{name}: median {statistics.median(timings) * 1e3:.2f} ms, "
              f"p95 {sorted(timings)[189] * 1e3:.2f} ms, {len(body)} bytes")


if __name__ == "__main__":
    main()
