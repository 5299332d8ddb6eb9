"""Per-tenant limits under a flood, over a real channel (docs/reliability.md test group D, eviction
flood; issue 10 item 3).

Tenant A runs 64 long ``no_cache`` Generates and warms 20 random long prompts at once, while
tenant B, whose prefix was warmed before, looks it up and generates. B must be served, and B's
prefix must stay cached locally (A is held to its default quota per tier, ``tenant_quota``) and
in Redis (A is held to its write budget, ``redis_write_bytes_per_s``, so its blocks cannot fill
a Redis with ``maxmemory`` and push B's out). A is held to its running and queued requests by
the engine's scheduler, and to its calls and Warm calls in flight by admission.

Scaled down to stay fast on a 2-core machine: the issue's counts (64 Generates, 20 warms), but
A's warmed prompts are 128 tokens (not 8k) and its Generates 16 tokens long (the tiny Llama's
greedy decode); Redis holds 2 MB and each tenant may write 16 KiB/s (two blocks) to it.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest

from gateway.cache.operations.factory import CacheConfig
from gateway.client import KvgateError, ResourceExhausted
from gateway.config.limits import LimitSettings
from gateway.core.requests import TokenDelta
from gateway.engine.models.loading import LoadedModel
from tests.gateway.grpc_harness import BLOCK, KEY_A, KEY_B, start_gateway, tiny_model, wait_until
from tests.redis_harness import RedisServer

KiB = 1 << 10
MiB = 1 << 20
PROMPT_TOKENS = 128
B_PREFIX_TOKENS = 2 * BLOCK  # 16 KiB of KV: within one second of B's budget


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 400) for _ in range(n)]  # the tokenizer knows 0..402


def run_threads(targets: list[Callable[[], None]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.slow
def test_a_flooding_tenant_leaves_another_served_and_its_prefix_cached_locally_and_in_redis(
    loaded: LoadedModel, redis_server_factory: Callable[..., RedisServer],
) -> None:
    redis_server = redis_server_factory(maxmemory="2mb", maxmemory_policy="allkeys-lru")
    redis = redis_server.client()
    running = start_gateway(loaded, cache_config=CacheConfig(
        block_tokens=BLOCK, device_bytes=MiB, host_bytes=MiB,
        tenant_quota={"device": MiB // 2, "host": MiB // 2},
        redis_url=redis_server.url, redis_timeout_s=5.0, redis_write_bytes_per_s=16 * KiB),
        limits=LimitSettings(max_calls_per_key=24))
    rng = random.Random(10)
    b_prefix = random_tokens(rng, B_PREFIX_TOKENS)
    # Each tenant on a connection of its own, as two app backends would be (grpc would otherwise
    # share one connection, and its stream cap, between the test's clients).
    tenant_b = running.client(KEY_B, options=[("kvgate.test.connection", "tenant-b")])
    assert tenant_b.warm(token_ids=b_prefix).num_new_blocks == 2
    assert running.opened is not None
    running.opened.hierarchy.flush(timeout_s=10.0)
    b_redis_keys = set(redis.keys("*"))
    assert len(b_redis_keys) == 2  # B's blocks, written within B's own budget

    stop = threading.Event()
    codes: Counter[str] = Counter()
    lock = threading.Lock()

    def count(what: str) -> None:
        with lock:
            codes[what] += 1

    a_clients = [running.client(KEY_A, timeout_s=120.0,
                                options=[("kvgate.test.connection", f"tenant-a-{i}")])
                 for i in range(4)]

    def long_generate(i: int) -> Callable[[], None]:
        def run() -> None:
            prompt = random_tokens(random.Random(1000 + i), 64)
            try:
                for item in a_clients[i % 4].generate(token_ids=prompt, max_tokens=16,
                                                      no_cache=True):
                    if stop.is_set():
                        break
                    if isinstance(item, TokenDelta):
                        count("generating")
            except ResourceExhausted:
                count("generate refused")
            except KvgateError as exc:
                count(f"generate ended: {exc.code.name}")
        return run

    warmed: list[int] = []

    def warm(i: int) -> Callable[[], None]:
        def run() -> None:
            prompt = random_tokens(random.Random(2000 + i), PROMPT_TOKENS)
            while not stop.is_set():
                try:
                    a_clients[i % 4].warm(token_ids=prompt)
                except ResourceExhausted:  # over A's calls or Warm calls in flight: try again
                    count("warm refused")
                    time.sleep(1.0)
                    continue
                except KvgateError as exc:  # the gateway stopped (the test is over), or a bug
                    count(f"warm ended: {exc.code.name}")
                    return
                with lock:
                    warmed.append(i)
                return
        return run

    threads = run_threads([long_generate(i) for i in range(64)] + [warm(i) for i in range(20)])
    try:
        # A holds every slot it may: its calls in flight, and the engine's running requests.
        assert wait_until(lambda: codes["generating"] > 0 and codes["generate refused"] > 0,
                          timeout_s=60)
        assert running.server.admission.snapshot().calls_by_principal["tenant 'tenant-a'"] <= 24
        lookup = tenant_b.lookup(token_ids=b_prefix)
        assert lookup.cached_tokens == B_PREFIX_TOKENS
        text, usage = tenant_b.generate_text(token_ids=b_prefix + [5, 6, 7], max_tokens=4)
        assert usage.cached_tokens == B_PREFIX_TOKENS and usage.completion_tokens >= 1
        assert wait_until(lambda: len(warmed) == 20, timeout_s=240), (len(warmed), codes)
        running.opened.hierarchy.flush(timeout_s=30.0)

        # B's prefix is still in the local tiers, and still in Redis, after A's 20 warms.
        after = tenant_b.lookup(token_ids=b_prefix)
        assert after.cached_tokens == B_PREFIX_TOKENS
        assert set(after.cached_tokens_by_tier) <= {"device", "host"}, after
        assert b_redis_keys <= set(redis.keys("*"))
        assert int(redis.info("stats")["evicted_keys"]) == 0
        notes = {s.name: s.notes for s in running.opened.cache.stats().stores}["redis"]
        assert int(notes["remote_writes_over_budget"]) > 0  # the budget held A back
        assert codes["warm refused"] > 0  # more than max_warms_per_key at once were refused
    finally:
        stop.set()
        running.stop()
        for thread in threads:
            thread.join(timeout=30)
