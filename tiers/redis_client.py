"""redis-py wiring of the Redis tier: building a client, closing it, faults, multi-key commands.

Split from ``tiers.redis_store`` so that the store reads as the tier's rules (a fault is a
miss, stored bytes are untrusted, one key per block) and this module as the mechanics of
talking to a Redis server or cluster: how a client is built (bounded socket timeouts, no
client-side retries), which exceptions are faults, how a cluster client is really closed, the
pipelined commands over many keys, and how a URL's password is kept out of every message.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry

RedisClient = redis.Redis | RedisCluster

# Every error redis-py raises for a server or network fault. DataError is excluded where it is
# caught: it means we passed bad arguments, a bug, and bugs raise.
REDIS_FAULTS = (RedisError, RedisClusterException)
# Faults that a retry in a few seconds cannot fix: the breaker opens at the first one.
AUTH_FAULTS = (AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError)

_SCAN_COUNT = 1000


def build_client(url: str, *, cluster: bool, socket_timeout_s: float,
                 connect_timeout_s: float) -> RedisClient:
    """A ``Redis`` (or, with ``cluster``, a ``RedisCluster``) client for ``url``.

    Raises:
        ValueError: the URL cannot be parsed (its message may quote the URL, password included).
        redis.exceptions.RedisError, RedisClusterException: a cluster client connects while
            it is built.
    """
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        # NOTE: no client-side retries: a retry doubles the stall of a request while the
        # caller could be recomputing; the breaker decides when to try again.
        "retry": Retry(NoBackoff(), 0),
        # Blocks are megabytes: reading a 94 MB chain 64 KiB at a time (redis-py's default)
        # took ~2,900 reads, 1 MiB ~100; the exact chain's fetch 200 -> 160 ms (2k tokens of
        # SmolLM2, loopback, the 2-core AMD EPYC, tools/profile/lower_tier_warm.py redis).
        # One such buffer per connection.
        "socket_read_size": 1 << 20,
    }
    if cluster:
        return RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


def close_client(client: RedisClient) -> None:
    """Close a client built by ``build_client``, every socket of it."""
    if isinstance(client, RedisCluster):
        # NOTE: RedisCluster.close() (redis-py 8.1) closes each node's Redis object, but a
        # node built from a URL gets its pool passed in, and Redis.close() only closes
        # pools it made itself: the sockets would stay open until garbage collection.
        for node in list(client.nodes_manager.nodes_cache.values()):
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
    client.close()


def scan_keys(client: RedisClient, pattern: str) -> Iterator[bytes]:
    """SCAN MATCH ``pattern`` over the server, or over every primary of a cluster."""
    if isinstance(client, RedisCluster):
        keys: Iterable[Any] = client.scan_iter(
            match=pattern, count=_SCAN_COUNT, target_nodes=RedisCluster.PRIMARIES
        )
    else:
        keys = client.scan_iter(match=pattern, count=_SCAN_COUNT)
    for key in keys:
        yield bytes(key)


def raise_first_error(
    replies: list[Any], allow: Callable[[Exception], bool] | None = None
) -> None:
    """Pipelines with raise_on_error=False return server errors inline; raise the first one
    that ``allow`` does not accept (connection errors are raised by redis-py itself)."""
    for reply in replies:
        if isinstance(reply, Exception) and not (allow is not None and allow(reply)):
            raise reply


def pipelined(client: RedisClient, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """Every reply of ``commands`` at once, from one pipeline (error replies inline)."""
    with client.pipeline(transaction=False) as pipe:
        for command in commands:
            pipe.execute_command(*command)
        return pipe.execute(raise_on_error=False)


def replies_as_they_arrive(client: RedisClient,
                           commands: Sequence[tuple[Any, ...]]) -> Generator[Any, None, None]:
    """Send ``commands`` in one write and yield each reply as it is read, an error reply as
    its exception (as ``pipeline().execute(raise_on_error=False)`` returns them, but one at a
    time): the caller works on one reply while the server sends the next. A cluster client's
    keys live on several nodes: its replies come from a pipeline, all at once.

    The connection goes back to the pool once every reply is read; a fault, or a caller that
    stops early, disconnects it first (its unread replies must not answer the next command).
    Connection faults are raised as redis-py raises them.
    """
    if isinstance(client, RedisCluster):
        yield from pipelined(client, commands)
        return
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        packed = connection.pack_commands(commands)  # type: ignore[no-untyped-call]
        connection.send_packed_command(packed)  # type: ignore[no-untyped-call]
        for _ in commands:
            try:
                reply = connection.read_response()
            except ResponseError as exc:
                reply = exc
            yield reply
    except BaseException:
        connection.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pool.release(connection)


def is_wrong_type(reply: Exception) -> bool:
    return isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE")


def unlink_all(client: RedisClient, redis_keys: Sequence[str | bytes]) -> int:
    """UNLINK keys in one pipeline (a cluster pipeline sends each node its own keys)."""
    with client.pipeline(transaction=False) as pipe:
        for redis_key in redis_keys:
            pipe.unlink(redis_key)
        replies = pipe.execute(raise_on_error=False)
    raise_first_error(replies)
    return sum(int(reply) for reply in replies)


def unlink_matching(client: RedisClient, pattern: str, *, min_idle_s: float | None = None,
                    batch: int = 512) -> int:
    """UNLINK every key matching ``pattern`` (SCAN on every primary), in batches; with
    ``min_idle_s``, only keys idle at least that long (``OBJECT IDLETIME``, whole seconds, not
    available under an LFU maxmemory-policy). Returns how many keys went.

    Raises:
        redis.exceptions.RedisError, RedisClusterException: a fault (keys already unlinked
            stay unlinked; run it again to finish).
    """
    num_removed = 0
    found: list[bytes] = []
    for key in scan_keys(client, pattern):
        found.append(key)
        if len(found) >= batch:
            num_removed += unlink_idle(client, found, min_idle_s)
            found = []
    if found:
        num_removed += unlink_idle(client, found, min_idle_s)
    return num_removed


def unlink_idle(client: RedisClient, keys: Sequence[str | bytes],
                min_idle_s: float | None) -> int:
    """UNLINK ``keys`` (with ``min_idle_s``: those idle at least that long); how many went."""
    if min_idle_s is not None:
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.object("IDLETIME", key)
            idle = pipe.execute(raise_on_error=False)
        raise_first_error([i for i in idle if not _is_no_such_key(i)])
        keys = [k for k, i in zip(keys, idle, strict=True)
                if isinstance(i, int) and i >= min_idle_s]
    return unlink_all(client, keys) if keys else 0


def _is_no_such_key(reply: object) -> bool:
    """OBJECT IDLETIME of a key that expired between SCAN and the call (None or an error)."""
    return reply is None or (isinstance(reply, ResponseError) and "no such key" in str(reply))


def glob_escape(text: str) -> str:
    """Escape Redis glob specials so a key prefix matches literally in SCAN MATCH."""
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def url_secrets(url: str) -> tuple[str, ...]:
    """The password of a Redis URL (userinfo or ?password=), raw and percent-encoded."""
    parts = urlsplit(url)
    found = [parts.password or ""]
    found += [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "password"]
    secrets: set[str] = set()
    for secret in found:
        if secret:
            secrets.update({secret, quote(secret, safe="")})
    return tuple(sorted(secrets, key=len, reverse=True))


def redact_url(url: str) -> str:
    """The URL with its password replaced by ``***`` (safe for logs)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            userinfo, _, hostport = netloc.rpartition("@")
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:***@{hostport}"
        query = urlencode(
            [
                (k, "***" if k == "password" else v)
                for k, v in parse_qsl(parts.query, keep_blank_values=True)
            ]
        )
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return "<unparseable Redis URL>"
