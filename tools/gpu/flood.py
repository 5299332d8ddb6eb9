"""Issue 24's overload target: USERS concurrent requests of TOKENS-token prompts, one tenant,
against a spawned ``kvgate serve`` on DEVICE: each must be answered or refused with
RESOURCE_EXHAUSTED (naming what ran out), none may fail otherwise (a CUDA out-of-memory
included), and the server must still answer afterwards.

    python3 tools/gpu/flood.py MODEL [DEVICE] [USERS] [TOKENS]
    (on a lent GPU: python3 .gpu-bundle/flood.py /tmp/models/8b cuda 64 8192)

Prints one line per outcome with its count and first message, and exits 1 if any request
ended otherwise or the server stopped answering. With the defaults one API key may have 16
calls in flight (``[limits] max_calls_per_key``): the rest are refused at the door, and the 16
admitted wait for the engine's KV budget (2 GiB: two 8k prompts of the 8B shape at a time). Run here with the bundled model and small
numbers (``PYTHONPATH=. .venv/bin/python tools/gpu/flood.py bundled cpu 24 300``: 16
answered, 8 refused naming the per-key limit, 14 s on a 2-core AMD EPYC) it checks itself.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.bench.spawn import spawn_gateway
from gateway.client import KvgateClient, KvgateError

MAX_TOKENS = 8


def main(argv: list[str]) -> int:
    model = argv[1] if len(argv) > 1 else "bundled"
    device = argv[2] if len(argv) > 2 else "auto"
    users = int(argv[3]) if len(argv) > 3 else 64
    tokens = int(argv[4]) if len(argv) > 4 else 8192
    outcomes: Counter[str] = Counter()
    first_message: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-flood-") as models, \
            spawn_gateway(model=model, models_dir=Path(models), block_tokens=64,
                          device_bytes=2 << 30, redis_url=None, redis_binary=None,
                          err=sys.stderr, label="flood", device=device) as endpoint:
        client = KvgateClient(endpoint.host, endpoint.port, endpoint.api_key, timeout_s=600.0)

        def one(user: int) -> tuple[str, str]:
            ids = random.Random(user).choices(range(100, 30_000), k=tokens)
            try:
                text, usage = client.generate_text(token_ids=ids, max_tokens=MAX_TOKENS)
            except KvgateError as exc:
                return exc.code.name, str(exc)
            return "answered", f"{usage.completion_tokens} tokens"

        started = time.perf_counter()
        with ThreadPoolExecutor(users) as pool:
            for outcome, message in pool.map(one, range(users)):
                outcomes[outcome] += 1
                first_message.setdefault(outcome, message)
        seconds = time.perf_counter() - started
        try:
            client.generate_text(token_ids=[100, 101, 102], max_tokens=2)
            alive = True
        except KvgateError as exc:
            alive = False
            first_message["after"] = str(exc)
    print(f"{users} users x {tokens} tokens on {device} ({model}), {seconds:.1f} s:")
    for outcome, count in outcomes.most_common():
        print(f"  {outcome}: {count} (first: {first_message[outcome][:160]})")
    print(f"  server answering afterwards: {alive}")
    allowed = {"answered", "RESOURCE_EXHAUSTED"}
    return 0 if alive and set(outcomes) <= allowed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
