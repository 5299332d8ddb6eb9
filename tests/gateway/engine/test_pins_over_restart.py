"""A pin outlives the process (issue 44: "0 pinned blocks lost from the disk tier across kill -9
and restarts"): a prefix an operator pinned through the admin path is, after a kill -9 and a
restart on the same disk, still pinned -- the tiers' policies cannot evict it, ``admin ls`` lists
it as pinned -- and served from disk, equal to the cold answer; an unpin outlives it too.

The kill -9 is a copy of the data directory taken the moment the admin call returned (what a
process killed then leaves behind: nothing of its close runs), and the restart a new cache and
engine over that copy.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.core.requests import WarmRequest
from gateway.engine.engine import Engine
from gateway.engine.models.loading import LoadedModel
from tests.gateway.engine.parity import (
    ALICE,
    BLOCK,
    PROMPT_BY_ID,
    SECRET,
    cache_config,
    make_engine,
    prompt_tokens,
    run,
)
from tests.redis_harness import RedisServer

PROMPT = PROMPT_BY_ID["over-4-blocks"]


def killed_after(root: Path, opened: OpenedCache, engine: Engine, to: Path) -> Path:
    """What a kill -9 of ``opened``'s process leaves of ``root`` now, as ``to``; then stops it."""
    shutil.copytree(root, to)
    engine.stop(grace_s=5)
    opened.close()
    return to


def pinned_then_killed(tiny: LoadedModel, tmp_path: Path, *, unpin: bool = False,
                       **config: object) -> Path:
    """Store ``PROMPT``, let it reach the disk, pin it as an operator does (and unpin it, if
    asked), then kill the process: the directory a restart finds."""
    opened = open_cache(cache_config(tmp_path / "run-1", **config), layout=tiny.layout,
                        deployment_secret=SECRET)
    engine = make_engine(tiny, opened)
    run(engine, PROMPT)
    assert opened.hierarchy.flush(timeout_s=10)  # on disk before the pin, as in any run
    admin = CacheAdmin(opened.cache, keys=engine)
    num_blocks = len(prompt_tokens(tiny, PROMPT)) // BLOCK
    assert admin.set_pinned(PROMPT, ALICE, True) == num_blocks
    if unpin:
        assert admin.set_pinned(PROMPT, ALICE, False) == num_blocks
    return killed_after(tmp_path / "run-1", opened, engine, tmp_path / "run-2")


def test_a_pinned_prefix_is_still_pinned_and_served_from_disk_after_a_kill_and_restart(
    tiny: LoadedModel, tmp_path: Path,
) -> None:
    root = pinned_then_killed(tiny, tmp_path)
    opened = open_cache(cache_config(root), layout=tiny.layout, deployment_secret=SECRET)
    engine = make_engine(tiny, opened)
    try:
        cold = run(engine, PROMPT, no_cache=True)[:2]
        num_blocks = len(prompt_tokens(tiny, PROMPT)) // BLOCK
        assert opened.num_recovered_blocks == num_blocks
        assert opened.cache.evict("disk", 10**12).victims == ()  # pinned: no policy takes it
        [listed] = CacheAdmin(opened.cache, keys=engine).list_prefixes(tenant="alice", limit=10)
        assert (listed.num_blocks, listed.is_pinned, listed.tiers) == (num_blocks, True, ("disk",))
        warm, text, usage = run(engine, PROMPT)
        assert (warm, text) == cold
        assert usage.cached_tokens_by_tier == {"disk": num_blocks * BLOCK}
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_a_prefix_warmed_with_a_pin_is_still_pinned_after_a_kill_and_restart(
    tiny: LoadedModel, tmp_path: Path,
) -> None:
    """The engine's loop pins a warm without saving the pin log; the warm's own thread saves
    it before the warm returns."""
    opened = open_cache(cache_config(tmp_path / "run-1"), layout=tiny.layout,
                        deployment_secret=SECRET)
    engine = make_engine(tiny, opened)
    result = engine.warm(WarmRequest(prompt=PROMPT, scope=ALICE, pin=True))
    assert opened.hierarchy.flush(timeout_s=10)
    root = killed_after(tmp_path / "run-1", opened, engine, tmp_path / "run-2")
    reopened = open_cache(cache_config(root), layout=tiny.layout, deployment_secret=SECRET)
    try:
        assert reopened.num_recovered_blocks == result.num_blocks
        assert reopened.cache.evict("disk", 10**12).victims == ()
    finally:
        reopened.close()


@pytest.mark.redis
def test_after_a_redis_restart_without_persistence_a_pinned_prefix_is_served_from_disk(
    tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer,
) -> None:
    """Issue 44: "after a Redis restart without persistence (as deploy/ runs it), pinned
    blocks are served again": the replica and Redis both killed, Redis back empty."""
    root = pinned_then_killed(tiny, tmp_path, redis_url=redis_server.url)
    assert redis_server.command("DBSIZE") != 0  # positive control: Redis held the prefix
    redis_server.kill()
    redis_server.start()
    assert redis_server.command("DBSIZE") == 0
    opened = open_cache(cache_config(root, redis_url=redis_server.url), layout=tiny.layout,
                        deployment_secret=SECRET)
    engine = make_engine(tiny, opened)
    try:
        cold = run(engine, PROMPT, no_cache=True)[:2]
        num_blocks = len(prompt_tokens(tiny, PROMPT)) // BLOCK
        assert opened.cache.evict("disk", 10**12).victims == ()
        warm, text, usage = run(engine, PROMPT)
        assert (warm, text) == cold
        assert usage.cached_tokens_by_tier == {"disk": num_blocks * BLOCK}
    finally:
        engine.stop(grace_s=5)
        opened.close()


def test_an_unpinned_prefix_is_not_pinned_after_a_kill_and_restart(
    tiny: LoadedModel, tmp_path: Path,
) -> None:
    root = pinned_then_killed(tiny, tmp_path, unpin=True)
    opened = open_cache(cache_config(root), layout=tiny.layout, deployment_secret=SECRET)
    try:
        num_blocks = len(prompt_tokens(tiny, PROMPT)) // BLOCK
        assert opened.num_recovered_blocks == num_blocks
        assert len(opened.cache.evict("disk", 10**12).victims) == num_blocks
    finally:
        opened.close()


@pytest.mark.redis
def test_a_prefix_another_replica_computed_is_on_this_disk_once_pinned_here(
    tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer,
) -> None:
    """A replica that read a prefix from Redis holds it in memory only; pinning it there
    copies it to its own disk, so that a kill -9, a restart and an empty Redis keep it."""
    first = open_cache(cache_config(tmp_path / "a", redis_url=redis_server.url),
                       layout=tiny.layout, deployment_secret=SECRET)
    first_engine = make_engine(tiny, first)
    run(first_engine, PROMPT)
    assert first.hierarchy.flush(timeout_s=10)
    first_engine.stop(grace_s=5)
    first.close()
    opened = open_cache(cache_config(tmp_path / "b", redis_url=redis_server.url),
                        layout=tiny.layout, deployment_secret=SECRET)
    engine = make_engine(tiny, opened)
    num_blocks = len(prompt_tokens(tiny, PROMPT)) // BLOCK
    assert run(engine, PROMPT)[2].cached_tokens_by_tier.get("redis") == num_blocks * BLOCK
    assert opened.hierarchy.flush(timeout_s=10)
    assert not any((tmp_path / "b" / "disk").rglob("*.kvb"))  # memory only, so far
    assert CacheAdmin(opened.cache, keys=engine).set_pinned(PROMPT, ALICE, True) == num_blocks
    assert opened.hierarchy.flush(timeout_s=10)
    root = killed_after(tmp_path / "b", opened, engine, tmp_path / "b-restarted")
    redis_server.kill()
    redis_server.start()
    reopened = open_cache(cache_config(root, redis_url=redis_server.url), layout=tiny.layout,
                          deployment_secret=SECRET)
    try:
        assert reopened.num_recovered_blocks == num_blocks
        assert reopened.cache.evict("disk", 10**12).victims == ()
    finally:
        reopened.close()
