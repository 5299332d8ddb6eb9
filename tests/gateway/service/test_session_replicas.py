"""A session across two replicas sharing one Redis: a reset through one replica drops what the
session owns on both and in Redis, and leaves the system prompt it shared.

Two real ``kvgate serve`` processes (``tests.gateway.service.test_replicas``: tiny Llama,
16-token blocks, a device tier each) on a redis-server of this test's own, so that every block
key in it is accounted for. The session's first turn runs on A, its second on B (which reads the
first from Redis); the reset goes through A and reaches B by the eviction stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.core.requests import Usage
from tests.gateway.service.test_replicas import (
    TENANT,
    Replica,
    _block_keys,
    _prompt,
    _wait_for_keys,
    launch_pair,
    stop_all,
)
from tests.redis_harness import RedisServer
from tests.tiny_llama import save_tiny_llama

SESSION = "chat-1"


@pytest.fixture
def pair(tmp_path: Path, redis_server: RedisServer) -> Iterator[tuple[Replica, Replica]]:
    started: list[Replica] = []
    try:
        yield launch_pair(tmp_path, save_tiny_llama(tmp_path / "model"), redis_server.url,
                          cluster=False, started=started)
    finally:
        stop_all(started)


def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.1)


def _turn(replica: Replica, messages: list[dict[str, str]]) -> tuple[str, Usage]:
    with replica.client() as client:
        return client.generate_text(messages=messages, max_tokens=8, session_id=SESSION)


def _sessions(replica: Replica) -> list[str]:
    with replica.client(admin=True) as admin:
        return [s.session_id for s in admin.list_sessions()]


def test_a_reset_through_one_replica_reaches_the_other_and_redis_and_keeps_the_system_prompt(
    pair: tuple[Replica, Replica], redis_server: RedisServer,
) -> None:
    a, b = pair
    system = [{"role": "system", "content": _prompt("sessions")}]
    with a.client() as client:
        warmed = client.warm(messages=system, add_generation_prompt=False)
    system_tokens = 16 * warmed.num_blocks
    _wait_for_keys(redis_server, warmed.num_blocks)
    system_keys = _block_keys(redis_server)
    messages = [*system, {"role": "user", "content": "How do refunds work for annual plans?"}]
    for replica, follow_up in ((a, "And for monthly plans?"), (b, "Thanks.")):
        text, usage = _turn(replica, messages)
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": follow_up}]
    assert usage.cached_tokens_by_tier.get("redis", 0) > 0, usage  # B read A's turn from Redis
    _wait_for_keys(redis_server, len(system_keys) + 2)  # both turns' writes have landed
    assert _block_keys(redis_server) > system_keys
    assert _sessions(a) == _sessions(b) == [SESSION]

    with a.client(admin=True) as admin:
        reset = admin.reset_session(SESSION, tenant=TENANT)
    assert reset.num_blocks > 0

    _until(lambda: _sessions(b) == [], "B applies the reset")
    _until(lambda: _block_keys(redis_server) == system_keys,
           "only the system prompt's blocks are left in Redis")
    assert _sessions(a) == []
    with a.client() as client:  # A still holds the system prompt, nothing of the session
        assert client.lookup(messages=messages).cached_tokens == system_tokens
    _, usage = _turn(b, messages)  # the next turn: cold but for the system prompt (from Redis)
    assert usage.cached_tokens <= system_tokens, usage
