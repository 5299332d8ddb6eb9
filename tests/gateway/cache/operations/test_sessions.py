"""Sessions in the cache: whose blocks are whose (``gateway.cache.sessions``), and what a reset,
an expiry or another replica's reset drops (``gateway.cache.operations.session_admin``).

A metadata-only cache and fake keys, as in ``test_admin``; ``ask`` tells the registry what the
engine tells it for one request (what it found cached, what it stored). The engine, the tiers
and Redis: ``tests/gateway/engine/test_sessions.py``; two replicas:
``tests/gateway/service/test_session_replicas.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.factory import CacheConfig
from gateway.cache.operations.invalidation import EvictionEvent
from gateway.cache.operations.session_admin import SessionAdmin, drop_expired_sessions
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.cache.sessions import SessionLimits
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError
from gateway.core.errors import InvalidRequest, MalformedEvent, NotFound
from gateway.core.fingerprint import Namespace
from gateway.core.sessions import session_id_problem
from gateway.core.tokens import TokenIds
from policies.registry import TierPolicyConfig, build_tier_policy
from tests.gateway.cache.operations.test_admin import (
    ALICE,
    BLOCK_BYTES,
    BOB,
    EVENT_BOUNDS,
    KEYS,
    FakeClock,
    store,
    toks,
)
from tiers.hierarchy import REMOTE

SYSTEM = (1, 2, 3, 4)
"""Two blocks of a system prompt (2-token blocks)."""


def make_cache(clock: FakeClock, *, ttl_s: float = 1800.0, max_per_tenant: int = 100
               ) -> PrefixCache:
    policy = build_tier_policy(TierPolicyConfig(order="lru", budget_bytes=10_000), clock=clock)
    return PrefixCache(tiers=[TierSlot(name="device", policy=policy)], block_tokens=2,
                       clock=clock,
                       sessions=SessionLimits(ttl_s=ttl_s, max_per_tenant=max_per_tenant))


def ask(cache: PrefixCache, namespace: Namespace, tokens: TokenIds, session: str | None = None,
        *, from_redis: bool = False) -> None:
    """One request's blocks, as the engine reports them: what it found cached (from Redis, if
    ``from_redis``), then what it stored."""
    with cache.acquire(namespace, tokens) as lease:
        tiers = [REMOTE if from_redis else "device"] * len(lease.records)
        cache.sessions.note_use(namespace, session, lease.records, tiers)
        start = lease.match.num_blocks
        cache.insert(lease, tier="device", block_bytes=BLOCK_BYTES)
        cache.sessions.note_stored(namespace, session, lease.keys[start:])


def cached(cache: PrefixCache, namespace: Namespace, *ids: int) -> int:
    return cache.lookup(namespace, toks(*ids)).num_blocks


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_reset_drops_the_sessions_own_conversation_and_keeps_the_warmed_system_prompt(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    ask(cache, ALICE, toks(*SYSTEM))  # warmed without a session
    ask(cache, ALICE, toks(*SYSTEM, 5, 6, 7, 8), "chat-1")
    [listed] = SessionAdmin(cache).list()
    assert (listed.tenant, listed.session_id, listed.num_blocks) == ("alice", "chat-1", 2)

    dropped = SessionAdmin(cache).reset("chat-1", tenant="alice")

    assert (dropped.num_blocks, dropped.bytes_by_tier) == (2, {"device": 2 * BLOCK_BYTES})
    assert cached(cache, ALICE, *SYSTEM, 5, 6, 7, 8) == 2  # the system prompt alone
    assert SessionAdmin(cache).list() == []
    cache.check_invariants()


def test_a_block_the_session_stored_first_stays_once_another_session_read_it(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    ask(cache, ALICE, toks(*SYSTEM, 5, 6), "chat-1")  # chat-1 stores the system prompt first
    ask(cache, ALICE, toks(*SYSTEM, 7, 8), "chat-2")
    SessionAdmin(cache).reset("chat-1", tenant="alice")
    assert cached(cache, ALICE, *SYSTEM, 7, 8) == 3  # chat-2's prompt, whole
    assert cached(cache, ALICE, *SYSTEM, 5, 6) == 2  # chat-1's own block went


def test_a_reset_never_takes_a_pinned_block_the_session_claimed_first(
    clock: FakeClock,
) -> None:
    """After a restart, a pinned system prompt adopted from disk is claimed by the first request
    that reads it: a session's reset must leave it (the 60-minute soak lost two pins so)."""
    cache = make_cache(clock)
    ask(cache, ALICE, toks(*SYSTEM, 5, 6), "chat-1")  # chat-1 claims the system prompt first
    assert cache.set_pinned(ALICE, toks(*SYSTEM), True) == 2
    dropped = SessionAdmin(cache).reset("chat-1", tenant="alice")
    assert dropped.num_blocks == 1  # its own block only
    assert cached(cache, ALICE, *SYSTEM, 5, 6) == 2
    cache.check_invariants()


def test_a_request_without_a_session_makes_a_block_it_reads_nobodys_own(clock: FakeClock) -> None:
    cache = make_cache(clock)
    ask(cache, ALICE, toks(*SYSTEM, 5, 6), "chat-1")
    ask(cache, ALICE, toks(*SYSTEM))  # e.g. a Warm of the system prompt, or a plain request
    assert SessionAdmin(cache).reset("chat-1", tenant="alice").num_blocks == 1
    assert cached(cache, ALICE, *SYSTEM) == 2


def test_a_reset_keeps_another_tenants_session_of_the_same_id(clock: FakeClock) -> None:
    cache = make_cache(clock)
    ask(cache, ALICE, toks(*SYSTEM), "chat-1")
    ask(cache, BOB, toks(*SYSTEM), "chat-1")
    SessionAdmin(cache).reset("chat-1", tenant="alice")
    assert cached(cache, ALICE, *SYSTEM) == 0
    assert cached(cache, BOB, *SYSTEM) == 2
    assert [(s.tenant, s.num_blocks) for s in SessionAdmin(cache).list()] == [("bob", 2)]


def test_another_tenants_session_is_not_found_exactly_as_one_that_never_existed(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    ask(cache, BOB, toks(*SYSTEM), "bobs-chat")
    answers = []
    for session in ("bobs-chat", "nobodys-chat"):
        with pytest.raises(NotFound) as excinfo:
            SessionAdmin(cache).reset(session, tenant="alice")
        answers.append(str(excinfo.value).replace(session, "ID"))
    assert answers[0] == answers[1]
    assert cached(cache, BOB, *SYSTEM) == 2
    assert SessionAdmin(cache).list(tenant="alice") == []


def test_a_reset_without_a_tenant_takes_the_one_tenant_with_that_id_and_refuses_two(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    ask(cache, BOB, toks(*SYSTEM), "chat-1")
    assert SessionAdmin(cache).reset("chat-1").tenant == "bob"
    ask(cache, ALICE, toks(5, 6), "chat-2")
    ask(cache, BOB, toks(5, 6), "chat-2")
    with pytest.raises(InvalidRequest, match="ambiguous.*'alice', 'bob'"):
        SessionAdmin(cache).reset("chat-2")


def test_a_session_ends_its_ttl_after_its_last_request(clock: FakeClock) -> None:
    cache = make_cache(clock, ttl_s=60.0)
    ask(cache, ALICE, toks(*SYSTEM))
    ask(cache, ALICE, toks(*SYSTEM, 5, 6), "chat-1")
    clock.now += 50
    ask(cache, ALICE, toks(*SYSTEM, 5, 6, 7, 8), "chat-1")  # the next turn: 60 s from now
    clock.now += 59
    assert drop_expired_sessions(cache) == 0
    [listed] = SessionAdmin(cache).list()
    assert (listed.idle_s, listed.expires_in_s) == (59.0, 1.0)

    clock.now += 1
    assert drop_expired_sessions(cache) == 1

    assert cached(cache, ALICE, *SYSTEM, 5, 6, 7, 8) == 2  # the system prompt stays
    assert SessionAdmin(cache).list() == []
    assert cache.stats().tiers[0].evictions == {"ttl": 2}


def test_a_tenant_past_its_session_limit_ends_its_least_recently_used_session(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock, max_per_tenant=2)
    for i, session in enumerate(("old", "mid", "new")):
        clock.now += 1
        ask(cache, ALICE, toks(10 + i, 10 + i), session)
    clock.now += 1
    ask(cache, BOB, toks(9, 9), "bobs")  # another tenant's count is its own
    assert [s.session_id for s in SessionAdmin(cache).list()] == ["bobs", "new", "mid"]
    assert drop_expired_sessions(cache) == 1
    assert cached(cache, ALICE, 10, 10) == 0
    assert cached(cache, ALICE, 11, 11) == cached(cache, ALICE, 12, 12) == 1


def test_a_listing_shows_blocks_bytes_and_time_left(clock: FakeClock) -> None:
    cache = make_cache(clock, ttl_s=100.0)
    ask(cache, ALICE, toks(*SYSTEM, 5, 6), "chat-1")
    clock.now += 30
    ask(cache, BOB, toks(7, 8), "chat-9")
    listed = SessionAdmin(cache).list()
    assert [(s.tenant, s.session_id, s.num_blocks, s.num_bytes, s.idle_s, s.expires_in_s)
            for s in listed] == [("bob", "chat-9", 1, BLOCK_BYTES, 0.0, 100.0),
                                 ("alice", "chat-1", 3, 3 * BLOCK_BYTES, 30.0, 70.0)]
    assert [s.session_id for s in SessionAdmin(cache).list(tenant="alice", limit=1)] == [
        "chat-1"]


def test_blocks_a_running_request_reads_stay_through_a_reset(clock: FakeClock) -> None:
    cache = make_cache(clock)
    ask(cache, ALICE, toks(5, 6, 7, 8), "chat-1")
    with cache.acquire(ALICE, toks(5, 6, 7, 8)):
        assert SessionAdmin(cache).reset("chat-1", tenant="alice").num_blocks == 0
    assert cached(cache, ALICE, 5, 6, 7, 8) == 2


def test_blocks_a_session_read_from_redis_are_its_own_here_but_not_stored_here(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    store(cache, ALICE, toks(5, 6, 7, 8))  # indexed, nobody's yet: as fetched from Redis
    ask(cache, ALICE, toks(5, 6, 7, 8, 9, 9), "chat-1", from_redis=True)
    with cache.placement.locked():
        sessions = sorted(r.session or "-" for r in cache.placement.index.records())
    assert sessions == ["chat-1", "~chat-1", "~chat-1"]
    assert SessionAdmin(cache).list()[0].num_blocks == 3
    assert SessionAdmin(cache).reset("chat-1", tenant="alice").num_blocks == 3


def test_another_replicas_reset_drops_only_that_tenants_session_here(clock: FakeClock) -> None:
    cache = make_cache(clock)
    ask(cache, ALICE, toks(5, 6), "chat-1")
    ask(cache, ALICE, toks(7, 8), "chat-2")
    ask(cache, BOB, toks(5, 6), "chat-1")
    CacheAdmin(cache, keys=KEYS).apply_event(EvictionEvent(tenant="alice", session="chat-1"))
    assert (cached(cache, ALICE, 5, 6), cached(cache, ALICE, 7, 8),
            cached(cache, BOB, 5, 6)) == (0, 1, 1)


class Published:
    def __init__(self) -> None:
        self.events: list[EvictionEvent] = []

    def publish(self, event: EvictionEvent) -> bool:
        self.events.append(event)
        return True


def test_a_reset_is_published_with_its_tenant_and_session_only(clock: FakeClock) -> None:
    cache = make_cache(clock)
    ask(cache, ALICE, toks(5, 6), "chat-1")
    feed = Published()
    CacheAdmin(cache, keys=KEYS, feed=feed).sessions.reset("chat-1")
    [event] = feed.events
    assert event.to_fields() == {"kind": "evict", "origin": "", "tenant": "alice",
                                 "session": "chat-1"}
    assert EvictionEvent.from_fields(event.to_fields(), EVENT_BOUNDS) == event


@pytest.mark.parametrize("fields", [
    {"kind": "evict", "session": "chat-1"},  # no tenant: never "every tenant's chat-1"
    {"kind": "evict", "tenant": "alice", "session": "chat 1"},
    {"kind": "evict", "tenant": "alice", "session": "chat-1", "everything": "1"},
    {"kind": "evict", "tenant": "alice", "session": "chat-1", "tag": "docs-v3"},
])
def test_a_session_event_naming_anything_else_is_skipped(fields: dict[str, str]) -> None:
    with pytest.raises(MalformedEvent):
        EvictionEvent.from_fields(fields, EVENT_BOUNDS)


@pytest.mark.parametrize("session_id", ["", "a b", "x" * 129, "chat/1", "~chat", "é"])
def test_a_session_id_is_short_and_printable(session_id: str) -> None:
    assert session_id_problem(session_id) is not None


def test_session_ids_as_apps_write_them_are_accepted() -> None:
    for session_id in ("chat-8f2c", "3f2b1c9e-77aa-4c1e-9d0b-5b1e2f3a4c5d", "alice@example.com",
                       "tenant:conv.42_b", "x" * 128):
        assert session_id_problem(session_id) is None


@pytest.mark.parametrize(("field", "value", "message"), [
    ("session_ttl_s", 0, "session_ttl_s must be a positive number of seconds"),
    ("session_ttl_s", float("inf"), "session_ttl_s must be a positive number of seconds"),
    ("max_sessions_per_tenant", 0, "max_sessions_per_tenant must be an integer from 1"),
])
def test_session_settings_are_checked(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CacheConfig(**{field: value})  # type: ignore[arg-type]


def test_session_settings_come_from_the_config_file_and_bad_ones_are_listed(
    tmp_path: Path,
) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[cache]\nsession_ttl_s = 60\nmax_sessions_per_tenant = 5\n"
                    "[http]\nsession_from_user = true\n", encoding="utf-8")
    config = load_serve_config(good)
    assert (config.cache.session_ttl_s, config.cache.max_sessions_per_tenant,
            config.http.session_from_user) == (60, 5, True)
    assert load_serve_config(None).http.session_from_user is False
    bad = tmp_path / "bad.toml"
    bad.write_text('[cache]\nsession_ttl_s = "soon"\n[http]\nsession_from_user = "yes"\n',
                   encoding="utf-8")
    with pytest.raises(ConfigError) as excinfo:
        load_serve_config(bad)
    assert "session_ttl_s must be a positive number" in str(excinfo.value)
    assert "http.session_from_user must be true or false" in str(excinfo.value)
