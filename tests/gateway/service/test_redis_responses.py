"""``RedisResponses``: stored responses shared by replicas through a real redis-server, under
the deployment's MAC, bounded and expiring per tenant as ``MemoryResponses`` is."""

from __future__ import annotations

import itertools
import time

import pytest
import redis

from gateway.service.http.errors import HttpFailure
from gateway.service.http.redis_responses import RedisResponses
from gateway.service.http.response_seal import responses_mac_key
from tests.redis_harness import RedisServer, free_port

TURN = ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"})
SECRET = b"s" * 32
_PREFIXES = (f"test{i}" for i in itertools.count())


@pytest.fixture
def client(module_redis_server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(module_redis_server.url)


def store(client: redis.Redis, *, prefix: str | None = None, secret: bytes = SECRET,
          max_per_tenant: int = 3, max_chars: int = 1000,
          ttl_s: float | None = 10.0) -> RedisResponses:
    return RedisResponses(client, key_prefix=prefix or next(_PREFIXES),
                          mac_key=responses_mac_key(secret), max_per_tenant=max_per_tenant,
                          max_chars_per_tenant=max_chars, default_ttl_s=ttl_s)


def _value_key(client: redis.Redis, prefix: str) -> bytes:
    keys = list(client.scan_iter(match=f"{prefix}:resp:*"))
    assert len(keys) == 1
    return bytes(keys[0])


def test_a_response_kept_by_one_replica_is_read_by_another(client: redis.Redis) -> None:
    prefix = next(_PREFIXES)
    store(client, prefix=prefix).put(id="resp_1", tenant="a", messages=TURN,
                                     body={"id": "resp_1"})
    found = store(client, prefix=prefix).get("a", "resp_1")
    assert found is not None and found.messages == TURN and found.body == {"id": "resp_1"}


def test_another_tenant_finds_nothing_and_deletes_nothing(client: redis.Redis) -> None:
    responses = store(client)
    responses.put(id="resp_1", tenant="a", messages=TURN, body={})
    assert responses.get("b", "resp_1") is None
    assert responses.delete("b", "resp_1") is False
    assert responses.get("a", "resp_1") is not None


def test_redis_keys_name_no_tenant(client: redis.Redis) -> None:
    prefix = next(_PREFIXES)
    store(client, prefix=prefix).put(id="resp_1", tenant="tenant-secret-name", messages=TURN,
                                     body={})
    assert not any(b"tenant-secret-name" in key for key in client.scan_iter(f"{prefix}:*"))


def test_a_value_changed_in_redis_is_dropped_and_read_as_missing(client: redis.Redis) -> None:
    prefix = next(_PREFIXES)
    responses = store(client, prefix=prefix)
    responses.put(id="resp_1", tenant="a", messages=TURN, body={})
    key = _value_key(client, prefix)
    value = client.get(key)
    assert isinstance(value, bytes)
    client.set(key, value.replace(b"hello", b"HELLO"))
    assert responses.get("a", "resp_1") is None
    assert client.exists(key) == 0


def test_a_value_moved_to_another_id_fails_its_mac(client: redis.Redis) -> None:
    prefix = next(_PREFIXES)
    responses = store(client, prefix=prefix)
    responses.put(id="resp_1", tenant="a", messages=TURN, body={})
    key = _value_key(client, prefix)
    client.set(key.replace(b"resp_1", b"resp_2"), client.get(key) or b"")
    assert responses.get("a", "resp_2") is None


def test_a_replica_with_another_secret_reads_nothing(client: redis.Redis) -> None:
    prefix = next(_PREFIXES)
    store(client, prefix=prefix).put(id="resp_1", tenant="a", messages=TURN, body={})
    assert store(client, prefix=prefix, secret=b"t" * 32).get("a", "resp_1") is None


def test_a_response_expires_its_ttl_after_its_last_read(client: redis.Redis) -> None:
    prefix = next(_PREFIXES)
    responses = store(client, prefix=prefix, ttl_s=0.4)
    responses.put(id="resp_1", tenant="a", messages=TURN, body={})
    time.sleep(0.25)
    assert responses.get("a", "resp_1") is not None  # refreshed: 0.4 s from now
    assert 250 < client.pttl(_value_key(client, prefix)) <= 400
    time.sleep(0.5)
    assert responses.get("a", "resp_1") is None


def test_one_more_than_the_limit_drops_the_tenants_least_recently_used(
        client: redis.Redis) -> None:
    responses = store(client, max_per_tenant=2)
    for name in ("resp_1", "resp_2"):
        responses.put(id=name, tenant="a", messages=TURN, body={})
        time.sleep(0.01)
    responses.put(id="resp_b", tenant="b", messages=TURN, body={})
    assert responses.get("a", "resp_1") is not None  # resp_2 is now the least recent
    time.sleep(0.01)
    responses.put(id="resp_3", tenant="a", messages=TURN, body={})
    assert [name for name in ("resp_1", "resp_2", "resp_3")
            if responses.get("a", name) is not None] == ["resp_1", "resp_3"]
    assert responses.get("b", "resp_b") is not None


def test_past_the_character_budget_the_tenants_least_recently_used_go_first(
        client: redis.Redis) -> None:
    responses = store(client, max_per_tenant=10, max_chars=20)
    chat = ({"role": "user", "content": "x" * 6}, {"role": "assistant", "content": "y" * 2})
    for name in ("resp_1", "resp_2", "resp_3"):  # 8 characters each: the third pushes one out
        responses.put(id=name, tenant="a", messages=chat, body={})
        time.sleep(0.01)
    assert responses.get("a", "resp_1") is None
    assert responses.chars_of("a") == 16
    assert responses.delete("a", "resp_2") is True and responses.chars_of("a") == 8


def test_an_unreachable_redis_is_a_503_to_read_and_a_logged_miss_to_keep(
        caplog: pytest.LogCaptureFixture) -> None:
    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_timeout=0.2,
                         socket_connect_timeout=0.2)
    responses = store(client)
    responses.put(id="resp_1", tenant="a", messages=TURN, body={})  # logged, not raised
    assert "could not be kept in Redis" in caplog.text
    with pytest.raises(HttpFailure) as raised:
        responses.get("a", "resp_1")
    assert raised.value.status == 503 and raised.value.code == "stored_responses_unavailable"
