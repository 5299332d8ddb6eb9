"""The eviction feed (``gateway.cache.invalidation``) on a real Redis stream: what one replica
publishes, the others apply; a replica catches up on what it missed while away, and empties its
local tiers when the stream no longer reaches back that far.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.cache.invalidation import EvictionEvent, EvictionFeed
from tests.redis_harness import RedisServer
from tiers.redis_events import RedisEventLog

STREAM = "kvgate:events"


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


class Replica:
    def __init__(self, url: str, origin: str, cursor: Path | None) -> None:
        self.applied: list[EvictionEvent] = []
        self.feed = EvictionFeed(RedisEventLog(url, name=STREAM, block_s=0.2),
                                 self.applied.append, origin=origin, cursor_path=cursor)

    def start(self) -> Replica:
        self.feed.start()
        assert self.feed.settled.wait(5.0)
        return self


@pytest.fixture
def replicas(redis_server: RedisServer, tmp_path: Path) -> Iterator[Callable[..., Replica]]:
    started: list[Replica] = []

    def start(origin: str, cursor: Path | None = None) -> Replica:
        replica = Replica(redis_server.url, origin, cursor).start()
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
