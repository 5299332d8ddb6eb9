"""redis-py wiring of the Redis tier (``tiers.redis_client``): passwords never survive
redaction, key prefixes match literally in SCAN, and replies read as they arrive leave the
connection clean (those against a real redis-server on loopback)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.redis_harness import RedisCluster, RedisServer
from tiers.redis_client import (
    build_client,
    glob_escape,
    redact_url,
    replies_as_they_arrive,
    url_secrets,
)


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://kvgate:s3cr%40t@host:6380/1", "rediss://kvgate:***@host:6380/1"),
        ("redis://host:6379/0?password=pw&db=1", "redis://host:6379/0?password=%2A%2A%2A&db=1"),
    ],
)
def test_a_redacted_url_holds_no_password(url: str, redacted: str) -> None:
    assert redact_url(url) == redacted


def test_the_secrets_of_a_url_come_raw_and_encoded_longest_first() -> None:
    assert url_secrets("redis://u:p@ss@host:1/0?password=other") == ("p%40ss", "other", "p@ss")
    assert url_secrets("redis://host:1/0") == ()


def test_glob_specials_are_escaped() -> None:
    assert glob_escape("kv*gate?[x]\\") == "kv\\*gate\\?\\[x\\]\\\\"


def test_a_bad_url_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        build_client("http://nowhere", cluster=False, socket_timeout_s=0.1,
                     connect_timeout_s=0.1)


def client_of(url: str, *, cluster: bool = False) -> redis.Redis | redis.RedisCluster:
    return build_client(url, cluster=cluster, socket_timeout_s=5.0, connect_timeout_s=5.0)


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client of a fresh server holding a = 1, b = 2 and the list ``listed``."""
    built = client_of(redis_server.url)
    assert isinstance(built, redis.Redis)
    built.set("a", b"1")
    built.set("b", b"2")
    built.rpush("listed", b"x")
    yield built
    built.close()


@pytest.mark.redis
def test_replies_arrive_in_order_with_an_error_reply_as_its_exception(
        client: redis.Redis) -> None:
    replies = list(replies_as_they_arrive(client, [("GET", "a"), ("GETRANGE", "listed", 0, 9),
                                                   ("GET", "absent"), ("PTTL", "a")]))
    assert replies[0] == b"1" and replies[2] is None and replies[3] == -1
    assert isinstance(replies[1], redis.ResponseError) and "WRONGTYPE" in str(replies[1])
    pool = client.connection_pool
    assert pool._in_use_connections == set()  # back in the pool, connected, reused next
    assert len(pool._available_connections) == 1 and client.get("a") == b"1"


@pytest.mark.redis
def test_a_caller_that_stops_early_leaves_no_reply_to_answer_the_next_command(
        client: redis.Redis) -> None:
    replies = replies_as_they_arrive(client, [("GET", "a"), ("GET", "a"), ("GET", "a")])
    assert next(replies) == b"1"
    replies.close()  # two replies unread: the connection is dropped, not reused
    assert client.get("b") == b"2"


@pytest.mark.redis
def test_a_clusters_replies_come_from_a_pipeline_over_its_nodes(
        redis_cluster: RedisCluster) -> None:
    client = client_of(redis_cluster.url, cluster=True)
    keys = [f"key-{i}" for i in range(12)]  # spread over the three masters' slots
    for i, key in enumerate(keys):
        client.set(key, str(i).encode())
    replies = list(replies_as_they_arrive(client, [("GET", key) for key in keys]))
    assert replies == [str(i).encode() for i in range(12)]
    client.close()
