"""The eviction feed (``gateway.cache.operations.invalidation``) on a real Redis stream: what one
replica publishes, the others apply; a replica catches up on what it missed while away, and empties
its local tiers when the stream no longer reaches back that far. What anyone who can write Redis
writes there is checked and bounded before it is tokenised, and skipped if it fails. """

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from gateway.cache.operations.admin import CacheAdmin, list_prefixes
from gateway.cache.operations.invalidation import KEY_HEX_CHARS, EvictionEvent, EvictionFeed
from gateway.core.canonical import PromptInput
from gateway.core.errors import MalformedEvent
from gateway.core.tokens import TokenIds
from tests.gateway.cache.operations import test_admin as admin_helpers
from tests.redis_harness import RedisServer
from tiers.redis_events import RedisEventLog

STREAM = "kvgate:events"
BOUNDS = admin_helpers.EVENT_BOUNDS
KEY_HEX = "ab01" * (KEY_HEX_CHARS // 4)


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
                                 self._record, origin=origin, bounds=BOUNDS, cursor_path=cursor)

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
    event = EvictionEvent(tenant="acme", prefix_text="You are: ü", key_hex=KEY_HEX,
                          older_than_s=90.5, tier="disk", everything=False, origin="r1")
    assert EvictionEvent.from_fields(event.to_fields(), BOUNDS) == event
    with pytest.raises(MalformedEvent, match="older_than_s"):
        EvictionEvent.from_fields({"kind": "evict", "older_than_s": "nan"}, BOUNDS)
    with pytest.raises(MalformedEvent, match="kind"):
        EvictionEvent.from_fields({"kind": "something-newer"}, BOUNDS)


@pytest.mark.parametrize("entry", [
    {"key_hex": "not-hex"},
    {"key_hex": "ab01"},  # a beginning of a key: the publisher sends the whole key
    {"key_hex": KEY_HEX.upper()},
    {"key_hex": KEY_HEX + "00"},
    {"key_hex": " " + KEY_HEX[1:]},
    {"everything": "yes"},
    {"older_than_s": "soon"},
    {"older_than_s": "-1"},
    {"older_than_s": "1" * 100},
    {"tenant": 7},
    {"tenant": ""},
    {"tenant": "t" * 129},
    {"tier": "disk" * 20},
    {"origin": "r" * 65},
    {"key_hex": b"ab01"},
    {"unknown": "1"},
    {"prefix_text": "a system prompt"},  # no tenant: never "every tenant's blocks"
    {"tenant": "acme", "prefix_text": "x" * (BOUNDS.max_prefix_chars + 1)},
])
def test_an_entry_with_a_field_of_the_wrong_type_value_or_size_is_malformed(
    entry: dict[str, object],
) -> None:
    with pytest.raises(MalformedEvent):
        EvictionEvent.from_fields({"kind": "evict", **entry}, BOUNDS)  # type: ignore[dict-item]


def test_a_malformed_entry_says_which_field_and_its_size_never_its_text() -> None:
    text = "secret " * 40_000
    with pytest.raises(MalformedEvent) as excinfo:
        EvictionEvent.from_fields({"kind": "evict", "tenant": "acme", "prefix_text": text},
                                  BOUNDS)
    assert str(excinfo.value) == (f"prefix_text has {len(text)} characters, more than "
                                  f"{BOUNDS.max_prefix_chars}")


def test_a_prefix_of_a_prompts_bound_is_an_event() -> None:
    text = "x" * BOUNDS.max_prefix_chars
    event = EvictionEvent.from_fields({"kind": "evict", "tenant": "acme", "prefix_text": text},
                                      BOUNDS)
    assert event.prefix_text == text


class CountingKeys(admin_helpers.FakeKeys):
    """``PromptKeys`` that remembers the length of every text it tokenised."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenised_chars: list[int] = []

    def prompt_tokens(self, prompt: PromptInput) -> TokenIds:
        if isinstance(prompt.prompt, str):
            self.tokenised_chars.append(len(prompt.prompt))
        return super().prompt_tokens(prompt)


def test_an_oversized_event_on_the_stream_is_skipped_untokenised_and_the_reader_goes_on(
    replicas: Callable[..., Replica], redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Replica B applies events to a real cache through CacheAdmin, as a gateway does.
    keys = CountingKeys()
    cache = admin_helpers.make_cache(admin_helpers.FakeClock())
    system = "You are the support assistant of Acme."
    admin_helpers.store(cache, admin_helpers.ALICE,
                        keys.prompt_tokens(PromptInput(prompt=system)))
    admin_helpers.store(cache, admin_helpers.BOB, admin_helpers.toks(5, 6, 7, 8))
    keys.tokenised_chars.clear()
    admin = CacheAdmin(cache, keys=keys)
    b = replicas("b", apply=admin.apply_event)
    # Anyone who can write Redis (the deployment's ACL user suffices) writes 8 MB of prefix.
    oversized = system * (8 * 2**20 // len(system))
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.xadd(STREAM, {"kind": "evict", "tenant": "alice", "prefix_text": oversized,
                             "origin": "x"})
        client.xadd(STREAM, {"kind": "evict", "tenant": "alice", "prefix_text": system,
                             "origin": "x"})
    finally:
        client.close()
    with caplog.at_level(logging.WARNING, logger="gateway.cache"):
        # Both handled (a generous bound: before issue 44's fix, tokenising the 8 MB took
        # seconds); what matters is how each was handled.
        wait_for(lambda: b.feed.num_applied + b.feed.num_malformed == 2, timeout_s=120.0)
    assert (b.feed.num_malformed, b.feed.num_applied, b.feed.num_failed) == (1, 1, 0)
    assert keys.tokenised_chars == [len(system)]  # the oversized text was never tokenised
    assert b.feed.is_reading and b.feed.behind_reason(max_quiet_s=30.0) is None
    assert {info.tenant for info in list_prefixes(cache)} == {"bob"}  # the valid one applied
    assert (f"prefix_text has {len(oversized)} characters, more than "
            f"{BOUNDS.max_prefix_chars}") in caplog.text
    assert "support assistant" not in caplog.text


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
        for entry in ({"kind": "evict", "key_hex": "zz", "tenant": "alice",
                       "prefix_text": "my secret prompt", "origin": "x"},
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
    owners = {info.tenant for info in list_prefixes(cache)}
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
