"""The eviction feed (``gateway.cache.invalidation``) on a real Redis stream: what one replica
publishes, the others apply; a replica catches up on what it missed while away, and empties its
local tiers when the stream no longer reaches back that far.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from gateway.cache.admin import CacheAdmin, list_prefixes
from gateway.cache.invalidation import EvictionEvent, EvictionFeed
from tests.gateway.cache import test_admin as admin_helpers
from tests.redis_harness import RedisServer
from tiers.redis_events import RedisEventLog

STREAM = "kvgate:events"


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


class Replica:
    def __init__(self, url: str, origin: str, cursor: Path | None,
                 apply: Callable[[EvictionEvent], None] | None = None) -> None:
        self.applied: list[EvictionEvent] = []
        self._apply = apply
        self.feed = EvictionFeed(RedisEventLog(url, name=STREAM, block_s=0.2),
                                 self._record, origin=origin, cursor_path=cursor)

    def _record(self, event: EvictionEvent) -> None:
        if self._apply is not None:
            self._apply(event)
        self.applied.append(event)

    def start(self) -> Replica:
        self.feed.start()
        assert self.feed.settled.wait(5.0)
        return self


@pytest.fixture
def replicas(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    started: list[Replica] = []

    def start(origin: str, cursor: Path | None = None,
              apply: Callable[[EvictionEvent], None] | None = None) -> Replica:
        replica = Replica(redis_server.url, origin, cursor, apply).start()
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.feed.stop()


def test_an_event_survives_the_stream_with_every_selector() -> None:
    event = EvictionEvent(tenant="acme", prefix_text="You are: ü", key_hex="ab01",
                          older_than_s=90.5, tier="disk", everything=False, origin="r1")
    assert EvictionEvent.from_fields(event.to_fields()) == event
    assert EvictionEvent.from_fields({"kind": "evict", "older_than_s": "nan"}) is None
    assert EvictionEvent.from_fields({"kind": "something-newer"}) is None


@pytest.mark.parametrize("entry", [
    {"key_hex": "not-hex"},
    {"everything": "yes"},
    {"older_than_s": "soon"},
    {"older_than_s": "-1"},
    {"tenant": 7},
    {"key_hex": b"ab01"},
    {"unknown": "1"},
])
def test_an_entry_with_a_field_of_the_wrong_type_or_value_is_no_event(
    entry: dict[str, object],
) -> None:
    assert EvictionEvent.from_fields({"kind": "evict", **entry}) is None  # type: ignore[dict-item]


def test_a_malformed_event_is_counted_and_skipped_and_later_evictions_still_apply(
    replicas: Callable[..., Replica], redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Replica B applies events to a real cache through CacheAdmin, as a gateway does.
    cache = admin_helpers.make_cache(admin_helpers.FakeClock())
    admin_helpers.store(cache, admin_helpers.ALICE, admin_helpers.toks(1, 2, 3, 4))
    admin_helpers.store(cache, admin_helpers.BOB, admin_helpers.toks(5, 6, 7, 8))
    admin = CacheAdmin(cache, keys=admin_helpers.KEYS)
    a = replicas("a")
    b = replicas("b", apply=admin.apply_event)
    # Anyone who can write Redis writes straight into the stream.
    client = redis.Redis.from_url(redis_server.url)
    try:
        for entry in ({"kind": "evict", "key_hex": "zz", "prefix_text": "my secret prompt",
                       "origin": "x"},
                      {"kind": "evict", "everything": "yes", "origin": "x"},
                      {"kind": "evict", "older_than_s": "soon", "origin": "x"},
                      {"kind": "evict", "surprise": "1", "origin": "x"}):
            client.xadd(STREAM, entry)  # type: ignore[arg-type]
        client.xadd(STREAM, {"kind": "evict", "tier": "nvme", "origin": "x"})  # not here
    finally:
        client.close()
    with caplog.at_level(logging.WARNING, logger="gateway.cache"):
        assert a.feed.publish(EvictionEvent(tenant="alice"))
        wait_for(lambda: [e.tenant for e in b.applied][-1:] == ["alice"])
    assert b.feed.num_malformed == 4 and b.feed.num_failed == 0
    assert b.feed.is_reading
    owners = {info.owner for info in list_prefixes(cache)}
    assert owners == {"bob"}  # alice's eviction applied; nothing malformed evicted bob's
    assert "skipping event" in caplog.text
    assert "my secret prompt" not in caplog.text


def test_an_event_whose_apply_raises_is_counted_and_the_reader_goes_on(
    replicas: Callable[..., Replica],
) -> None:
    def apply(event: EvictionEvent) -> None:
        if event.tenant == "boom":
            raise RuntimeError("a bug in applying")

    a = replicas("a")
    b = replicas("b", apply=apply)
    assert a.feed.publish(EvictionEvent(tenant="boom"))
    assert a.feed.publish(EvictionEvent(tenant="acme"))
    wait_for(lambda: [e.tenant for e in b.applied] == ["acme"])
    assert b.feed.num_failed == 1 and b.feed.num_applied == 1
    assert b.feed.is_reading


def test_what_one_replica_publishes_the_others_apply_and_it_does_not(
    replicas: Callable[..., Replica],
) -> None:
    a, b = replicas("a"), replicas("b")
    assert a.feed.publish(EvictionEvent(tenant="acme"))
    wait_for(lambda: len(b.applied) == 1)
    assert b.applied[0].tenant == "acme" and b.applied[0].origin == "a"
    time.sleep(0.3)
    assert a.applied == []  # it evicted locally before publishing


def test_a_replica_catches_up_after_a_restart_from_its_saved_cursor(
    replicas: Callable[..., Replica], tmp_path: Path,
) -> None:
    a = replicas("a")
    cursor = tmp_path / "eviction-cursor"
    b = replicas("b", cursor)
    b.feed.stop()  # B goes down ...
    a.feed.publish(EvictionEvent(tenant="acme"))  # ... and misses this
    again = replicas("b2", cursor)  # B again (a new process, a new origin)
    assert again.feed.caught_up.wait(5.0)
    assert [e.tenant for e in again.applied] == ["acme"]


def test_a_replica_away_longer_than_the_stream_remembers_empties_its_tiers(
    replicas: Callable[..., Replica], redis_server: RedisServer, tmp_path: Path,
) -> None:
    a = replicas("a")
    a.feed.publish(EvictionEvent(tenant="first"))
    cursor = tmp_path / "eviction-cursor"
    b = replicas("b", cursor)
    b.feed.stop()
    for i in range(3):
        a.feed.publish(EvictionEvent(tenant=f"missed-{i}"))
    redis_server.command("XTRIM", STREAM, "MAXLEN", 1)  # the stream forgets what B missed
    again = replicas("b2", cursor)
    assert again.feed.caught_up.wait(5.0)
    assert again.applied[0].everything and again.applied[0].origin == "gap"
    assert [e.tenant for e in again.applied[1:]] == ["missed-2"]


def test_a_reading_feed_is_not_behind_and_a_stopped_one_says_why(replicas) -> None:
    replica = replicas("b")
    wait_for(lambda: replica.feed.last_read_at is not None)
    assert replica.feed.behind_reason(max_quiet_s=5.0) is None
    replica.feed.stop()
    assert replica.feed.behind_reason(max_quiet_s=5.0) == "the eviction reader is not running"


def test_a_feed_that_cannot_reach_the_stream_is_behind_after_the_quiet_bound(
        redis_server: RedisServer) -> None:
    replica = Replica(redis_server.url, "b", None)
    try:
        replica.start()
        wait_for(lambda: replica.feed.last_read_at is not None)
        redis_server.stop()
        time.sleep(0.6)
        reason = replica.feed.behind_reason(max_quiet_s=0.5)
        assert reason is not None and "has not been read for" in reason
    finally:
        replica.feed.stop()
