"""The other process of the Redis parity test: a second engine that fills a shared Redis.

``python -m tests.gateway.engine.redis_writer MODEL_DIR REDIS_URL WORKDIR [DEVICE]`` loads the
tiny Llama from ``MODEL_DIR`` (on ``DEVICE``, default cpu, in the dtype served there), runs every
parity prompt once through an engine whose cache writes through to ``REDIS_URL`` (no disk tier),
waits until the remote writes are done and prints one JSON line: for each prompt id, the greedy
token ids it generated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gateway.cache.operations.factory import open_cache
from tests.gateway.engine.parity import (
    PARITY_PROMPTS,
    SECRET,
    cache_config,
    load_tiny_as_served,
    make_engine,
    run,
)


def main(argv: list[str]) -> int:
    model_dir, redis_url, workdir, *rest = argv
    device = rest[0] if rest else "cpu"
    tiny = load_tiny_as_served(model_dir, device)
    opened = open_cache(cache_config(Path(workdir), redis_url=redis_url, disk_bytes=0),
                        layout=tiny.layout, deployment_secret=SECRET, device=device)
    engine = make_engine(tiny, opened)
    try:
        outputs = {name: run(engine, prompt)[0] for name, prompt in PARITY_PROMPTS}
        if not opened.hierarchy.flush(timeout_s=60):
            print("the remote writes did not finish", file=sys.stderr)
            return 1
    finally:
        engine.stop()
        opened.close()
    print(json.dumps(outputs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
