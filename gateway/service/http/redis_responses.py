"""Stored responses in the Redis every replica shares, so that a conversation continued
through ``previous_response_id`` (or read with ``GET /v1/responses/{id}``) may reach any
replica, and a restart forgets nothing.

The same contract as ``MemoryResponses``: a response belongs to the tenant whose key made it,
expires ``ttl_s`` after its last use, and a tenant keeps at most ``max_per_tenant`` responses
and ``max_chars_per_tenant`` characters of conversation, its least recently used dropped first.

In Redis, per tenant (under a keyed digest of its name, never the name; one hash tag, so that
a cluster keeps a tenant's keys on one node):

- ``{prefix}:resp:{tag}:{id}``: a MAC (32 bytes) then the response as JSON, expiring with it;
- ``{prefix}:resp-lru:{tag}``: a sorted set of the tenant's ids by last use;
- ``{prefix}:resp-chars:{tag}``: a hash of each id's characters.

The MAC is BLAKE2b under a key derived from the deployment secret for this use alone, over the
tenant's tag, the id and the JSON: whoever can write to Redis without the secret cannot make a
replica serve a conversation it did not keep, nor move one to another tenant or id. A value
that fails it is dropped and read as missing (a 404), with a warning. What Redis holds is the
conversation's text: docs/security.md says so.

Redis unreachable: reading answers 503 (``stored_responses_unavailable``, retry later); a
response that could not be kept is logged, its answer still sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError

from gateway.service.http.errors import HttpFailure
from gateway.service.http.response_seal import ResponseSeal
from gateway.service.http.stored_responses import StoredResponse, chars_of_conversation

logger = logging.getLogger(__name__)

BOOKKEEPING_TTL_S = 24 * 3600.0
"""The least a tenant's id list and sizes outlive their last use (the longest retention a
request may ask, a day): they go once every response they name has."""


class RedisResponses:
    """Stored responses in Redis, shared by every replica that has the deployment secret.

    Args:
        client: a client of the Redis the cache shares (``tiers.redis_client.build_client``).
        key_prefix: ``[cache] redis_key_prefix``.
        mac_key: ``response_seal.responses_mac_key(deployment_secret)``.
        max_per_tenant, max_chars_per_tenant, default_ttl_s: as ``MemoryResponses``'.
        clock: wall-clock seconds (the order of last uses, shared by every replica).
    """

    def __init__(self, client: Any, *, key_prefix: str, mac_key: bytes, max_per_tenant: int,
                 max_chars_per_tenant: int, default_ttl_s: float | None,
                 clock: Callable[[], float] = time.time) -> None:
        if max_per_tenant < 1 or max_chars_per_tenant < 1:
            raise ValueError(f"max_per_tenant and max_chars_per_tenant must be >= 1, got "
                             f"{max_per_tenant} and {max_chars_per_tenant}")
        self._client = client
        self._prefix = key_prefix
        self._seal = ResponseSeal(mac_key)
        self._max = max_per_tenant
        self._max_chars = max_chars_per_tenant
        self._default_ttl_s = default_ttl_s
        self._clock = clock

    def put(self, *, id: str, tenant: str, messages: Sequence[Mapping[str, str]],
            body: Mapping[str, object], ttl_s: float | None = None) -> None:
        """Keep a response (``ttl_s`` None: the store's default); logged if Redis fails."""
        ttl = self._default_ttl_s if ttl_s is None else ttl_s
        tag = self._tag(tenant)
        chars = chars_of_conversation(messages)
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.set(self._value_key(tag, id), self._seal.sealed(tag, id, messages, body, ttl),
                     px=None if ttl is None else int(ttl * 1000))
            pipe.zadd(self._lru_key(tag), {id: self._clock()})
            pipe.hset(self._chars_key(tag), id, chars)
            self._keep_bookkeeping(pipe, tag, ttl)
            pipe.execute()
            self._trim(tag, keep=id)
        except RedisError as exc:
            logger.warning("a response (%s) could not be kept in Redis, so it cannot be "
                           "continued or read: %s", id, exc)

    def get(self, tenant: str, id: str) -> StoredResponse | None:
        """``tenant``'s response ``id``, its expiry refreshed; None if it has none such.

        Raises:
            HttpFailure: 503, Redis could not be read.
        """
        tag = self._tag(tenant)
        try:
            value = self._client.get(self._value_key(tag, id))
            if value is None:
                self._forget_bookkeeping(tag, id)
                return None
            fields = self._seal.opened(tag, id, bytes(value), "Redis")
            if fields is None:
                self._forget(tag, id)
                return None
            ttl = None if fields.get("ttl_s") is None else float(fields["ttl_s"])
            pipe = self._client.pipeline(transaction=False)
            if ttl is not None:
                pipe.pexpire(self._value_key(tag, id), int(ttl * 1000))
            pipe.zadd(self._lru_key(tag), {id: self._clock()})
            self._keep_bookkeeping(pipe, tag, ttl)
            pipe.execute()
        except RedisError as exc:
            raise _unavailable(exc) from None
        return StoredResponse(id=id, tenant=tenant,
                              messages=tuple(dict(m) for m in fields["messages"]),
                              body=fields["body"], ttl_s=ttl)

    def delete(self, tenant: str, id: str) -> bool:
        """Drop ``tenant``'s response ``id``; whether it had one.

        Raises:
            HttpFailure: 503, Redis could not be reached.
        """
        try:
            return self._forget(self._tag(tenant), id)
        except RedisError as exc:
            raise _unavailable(exc) from None

    def chars_of(self, tenant: str) -> int:
        """The characters of conversation ``tenant`` keeps now."""
        try:
            return sum(int(v) for v in self._client.hvals(self._chars_key(self._tag(tenant))))
        except RedisError as exc:
            raise _unavailable(exc) from None

    # ---- bookkeeping ------------------------------------------------------------------

    def _trim(self, tag: str, *, keep: str) -> None:
        """Drop the tenant's least recently used responses while it is over either bound
        (never ``keep``, the one just kept)."""
        while True:
            sizes = self._client.hgetall(self._chars_key(tag))
            if len(sizes) <= 1 or (len(sizes) <= self._max
                                   and sum(int(v) for v in sizes.values()) <= self._max_chars):
                return
            oldest = [bytes(m).decode() for m in self._client.zrange(self._lru_key(tag), 0, 1)]
            victim = next((m for m in oldest if m != keep), None)
            if victim is None:
                return
            self._forget(tag, victim)

    def _forget(self, tag: str, id: str) -> bool:
        pipe = self._client.pipeline(transaction=False)
        pipe.delete(self._value_key(tag, id))
        pipe.zrem(self._lru_key(tag), id)
        pipe.hdel(self._chars_key(tag), id)
        return bool(pipe.execute()[0])

    def _forget_bookkeeping(self, tag: str, id: str) -> None:
        """An expired response's id and size (its value already gone)."""
        pipe = self._client.pipeline(transaction=False)
        pipe.zrem(self._lru_key(tag), id)
        pipe.hdel(self._chars_key(tag), id)
        pipe.execute()

    def _keep_bookkeeping(self, pipe: Any, tag: str, ttl: float | None) -> None:
        longest = max(BOOKKEEPING_TTL_S, ttl if ttl is not None else 0.0,
                      self._default_ttl_s or 0.0)
        for key in (self._lru_key(tag), self._chars_key(tag)):
            pipe.pexpire(key, int(longest * 1000))

    # ---- keys and MACs ----------------------------------------------------------------

    def _tag(self, tenant: str) -> str:
        return "{" + self._seal.tag(tenant) + "}"  # a hash tag: one cluster node per tenant

    def _value_key(self, tag: str, id: str) -> str:
        return f"{self._prefix}:resp:{tag}:{id}"

    def _lru_key(self, tag: str) -> str:
        return f"{self._prefix}:resp-lru:{tag}"

    def _chars_key(self, tag: str) -> str:
        return f"{self._prefix}:resp-chars:{tag}"


def _unavailable(exc: RedisError) -> HttpFailure:
    return HttpFailure(status=503, type="service_unavailable_error",
                       code="stored_responses_unavailable",
                       message=f"stored responses are kept in Redis, which could not be "
                               f"reached ({type(exc).__name__}); try again shortly")
