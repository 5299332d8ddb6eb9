"""A session's blocks and tail leave every tier -- device, host, disk and a real Redis -- on a
reset and when it expires, and its next request starts cold while the system prompt it shared
still hits.

The tiny Llama on 16-token blocks over the four tiers (``redis_server`` is a real redis-server
started by the harness); the cache runs on an injected clock, so an expiry needs no sleeping.
The ownership rule itself: ``tests/gateway/cache/operations/test_sessions.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.cache.operations.session_admin import drop_expired_sessions
from gateway.cache.sessions import session_of
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest
from gateway.core.fingerprint import Scope
from gateway.core.requests import (
    CacheOptions,
    GenerateRequest,
    LookupRequest,
    SamplingParams,
    TokenDelta,
    Usage,
    WarmRequest,
)
from gateway.engine.engine import Engine
from gateway.engine.models.loading import LoadedModel
from tests.gateway.engine.parity import BLOCK, SECRET, cache_config, make_engine
from tests.redis_harness import RedisServer
from tiers.base import BlockMeta
from tiers.redis_store import RedisStore

ALICE = Scope.of_tenant("alice")
SYSTEM = [(5 * i + 3) % 400 for i in range(2 * BLOCK)]
"""A system prompt of exactly two blocks, warmed without a session."""
QUESTION = [(7 * i + 11) % 400 for i in range(27)]
TTL_S = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


Stack = tuple[Engine, OpenedCache, Clock]


@pytest.fixture
def stack(tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer) -> Iterator[Stack]:
    """Device, host, disk and Redis tiers on a clock of the test's; no sweeper runs by itself."""
    clock = Clock()
    opened = open_cache(cache_config(tmp_path, redis_url=redis_server.url, session_ttl_s=TTL_S,
                                     sweep_interval_s=1e6),
                        layout=tiny.layout, deployment_secret=SECRET, clock=clock)
    engine = make_engine(tiny, opened)
    yield engine, opened, clock
    engine.stop(grace_s=5)
    opened.close()


def generate(engine: Engine, tokens: list[int], session: str | None = "chat-1", *,
             no_cache: bool = False) -> tuple[list[int], Usage]:
    ids: list[int] = []
    usage = None
    for event in engine.generate(GenerateRequest(
            prompt=PromptInput(token_ids=tokens), scope=ALICE,
            sampling=SamplingParams(max_tokens=21),
            cache=CacheOptions(session_id=session, no_cache=no_cache))):
        if isinstance(event, TokenDelta):
            ids.extend(event.token_ids)
        else:
            usage = event
    assert usage is not None
    return ids, usage


def converse(engine: Engine, opened: OpenedCache) -> list[int]:
    """Two turns of session chat-1 under the warmed system prompt, the first turn's blocks
    moved down to the host tier in between; the next turn's prompt."""
    engine.warm(WarmRequest(prompt=PromptInput(token_ids=SYSTEM), scope=ALICE))
    answer, _ = generate(engine, SYSTEM + QUESTION)
    opened.cache.evict("device", 1 << 40)  # every block down to host: the next turn reads it
    turn = SYSTEM + QUESTION + answer + [17, 18, 19, 20, 21]
    answer, _ = generate(engine, turn)
    assert opened.hierarchy.flush(timeout_s=10.0)  # disk and Redis writes have landed
    return turn + answer + [30, 31, 32]


def metas(opened: OpenedCache, *, mine: bool) -> list[BlockMeta]:
    """The session's own blocks (``mine``), or every other block."""
    placement = opened.cache.placement
    with placement.locked():
        return [placement.meta(r) for r in placement.index.records()
                if (session_of(r) == "chat-1") == mine]


def tiers_of(opened: OpenedCache, meta: BlockMeta) -> set[str]:
    held = {name for name in ("device", "host", "disk")
            if opened.hierarchy.store(name).contains(meta.key)}
    remote = opened.hierarchy.remote
    assert isinstance(remote, RedisStore)
    return held | ({"redis"} if remote.contains_meta(meta) else set())


def cached(engine: Engine, tokens: list[int]) -> int:
    return engine.lookup(LookupRequest(prompt=PromptInput(token_ids=tokens),
                                       scope=ALICE)).cached_tokens


def assert_gone_but_the_system_prompt(engine: Engine, opened: OpenedCache,
                                      own: list[BlockMeta], turn: list[int]) -> None:
    assert opened.hierarchy.flush(timeout_s=10.0)
    assert [tiers_of(opened, meta) for meta in own] == [set()] * len(own)
    shared = metas(opened, mine=False)
    assert len(shared) == 2 and all({"disk", "redis"} <= tiers_of(opened, m) for m in shared)
    assert engine.tail_counters.num_bytes == 0
    assert cached(engine, turn) == len(SYSTEM)
    ids, usage = generate(engine, turn)  # the session's next request: cold but for SYSTEM
    assert usage.cached_tokens <= len(SYSTEM)
    assert ids == generate(engine, turn, session=None, no_cache=True)[0]


def test_a_reset_drops_the_sessions_blocks_from_every_tier_and_redis_and_its_tail(
    stack: Stack,
) -> None:
    engine, opened, _ = stack
    turn = converse(engine, opened)
    own = metas(opened, mine=True)
    assert len(own) >= 3
    held = set().union(*(tiers_of(opened, meta) for meta in own))
    assert held == {"device", "host", "disk", "redis"}
    assert engine.tail_counters.num_bytes > 0

    dropped = CacheAdmin(opened.cache, keys=engine).sessions.reset("chat-1", tenant="alice")

    assert dropped.num_blocks == len(own) and dropped.tail_bytes > 0
    assert set(dropped.bytes_by_tier) == {"device", "host", "disk"}
    assert_gone_but_the_system_prompt(engine, opened, own, turn)


def test_an_idle_session_expires_from_every_tier_and_redis(stack: Stack) -> None:
    engine, opened, clock = stack
    turn = converse(engine, opened)
    own = metas(opened, mine=True)
    clock.now += TTL_S - 1
    assert drop_expired_sessions(opened.cache) == 0
    assert all(tiers_of(opened, meta) for meta in own)

    clock.now += 1
    assert drop_expired_sessions(opened.cache) == 1

    assert_gone_but_the_system_prompt(engine, opened, own, turn)


def test_the_engine_refuses_a_session_with_no_cache_or_in_the_shared_scope(
    stack: Stack,
) -> None:
    engine, _, _ = stack
    for scope, no_cache in ((ALICE, True), (Scope.shared(), False)):
        with pytest.raises(InvalidRequest, match="session"):
            engine.generate(GenerateRequest(
                prompt=PromptInput(token_ids=SYSTEM), scope=scope,
                cache=CacheOptions(session_id="chat-1", no_cache=no_cache)))
