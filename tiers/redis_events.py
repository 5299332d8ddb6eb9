"""A log of events shared by every replica, kept in one Redis stream.

An admin eviction through one replica must reach the local tiers of every other replica, or they
keep serving the evicted prefix (docs/design.md "Scaling past one machine"). Pub/sub would lose what
a replica misses while it is disconnected or restarting; a Redis *stream* keeps the last
``max_len`` events with increasing ids, so a replica that reads from the id it last saw misses
nothing, and one whose id is older than the oldest kept knows it missed something.

This module is only the log: ``append`` (XADD, trimmed to about ``max_len``), ``read_after``
(XREAD, blocking up to ``block_s``), ``last_id`` and ``first_id``. What the events mean and what
a replica does with them is ``gateway.cache.operations.invalidation``'s. Fields are short
strings, never prompts' KV; prefix text an operator evicts by does travel (the stream needs the same
ACL and TLS as the rest of the deployment's keys).

It has its own client: a blocking read holds its connection for ``block_s``, which must not
stall the block traffic of ``tiers.redis_store``. Faults raise (the reader retries; an append
that fails is reported to the caller, which says so to the operator).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from tiers.base import TierConfigError
from tiers.redis_client import REDIS_FAULTS, RedisClient, build_client, close_client, redact_url

__all__ = ["REDIS_FAULTS", "RedisEventLog"]

Event = tuple[str, dict[str, str]]
"""An event as read: its stream id and its fields."""


class RedisEventLog:
    """One Redis stream of events (see the module docstring).

    Args:
        url: the Redis (or a node of the cluster) of the deployment.
        name: the stream's key (``{key_prefix}:events``: outside the block keys' pattern, so a
            flush of every block never removes it).
        cluster: ``url`` names a node of a Redis Cluster.
        max_len: about how many events the stream keeps.
        block_s: the longest one ``read_after`` waits for an event.
        timeout_s: bound on every other call.
    """

    def __init__(self, url: str, *, name: str, cluster: bool = False, max_len: int = 10_000,
                 block_s: float = 1.0, timeout_s: float = 1.0) -> None:
        if max_len < 1 or not block_s > 0 or not timeout_s > 0:
            raise TierConfigError("max_len must be >= 1 and block_s, timeout_s > 0")
        self.name = name
        self.where = redact_url(url)
        self._url = url
        self._is_cluster = cluster
        self._max_len = max_len
        self._block_ms = max(1, round(block_s * 1000))
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._client: RedisClient | None = None

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            close_client(client)

    def append(self, fields: Mapping[str, str]) -> str:
        """Add an event; its id.

        Raises:
            redis.exceptions.RedisError, RedisClusterException: a fault.
        """
        entry: dict[Any, Any] = dict(fields)
        event_id = self._ensure_client().xadd(self.name, entry, maxlen=self._max_len,
                                              approximate=True)
        return _text(event_id)

    def last_id(self) -> str:
        """The id of the newest event ("0-0" for an empty stream).

        Raises:
            redis.exceptions.RedisError, RedisClusterException: a fault.
        """
        newest = self._ensure_client().xrevrange(self.name, "+", "-", count=1)
        return _text(newest[0][0]) if newest else "0-0"

    def first_id(self) -> str | None:
        """The id of the oldest event kept, None for an empty stream.

        Raises:
            redis.exceptions.RedisError, RedisClusterException: a fault.
        """
        oldest = self._ensure_client().xrange(self.name, "-", "+", count=1)
        return _text(oldest[0][0]) if oldest else None

    def read_after(self, cursor: str, *, count: int = 100) -> list[Event]:
        """The events after id ``cursor``, oldest first; waits up to ``block_s`` for one.

        Raises:
            redis.exceptions.RedisError, RedisClusterException: a fault.
        """
        reply: Any = self._ensure_client().xread({self.name: cursor}, count=count,
                                                 block=self._block_ms)
        events: list[Event] = []
        for _, entries in reply or ():
            for event_id, fields in entries:
                events.append((_text(event_id), {_text(k): _text(v) for k, v in fields.items()}))
        return events

    def _ensure_client(self) -> RedisClient:
        with self._lock:
            if self._client is None:
                try:
                    self._client = build_client(
                        self._url, cluster=self._is_cluster,
                        # A blocking read holds the socket for block_ms: allow for it.
                        socket_timeout_s=self._timeout_s + self._block_ms / 1000,
                        connect_timeout_s=self._timeout_s)
                except ValueError:
                    raise TierConfigError(f"bad Redis URL {self.where}") from None
            return self._client


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
