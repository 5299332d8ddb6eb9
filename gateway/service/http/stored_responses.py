"""Responses a tenant asked to keep (OpenAI's ``store``), for ``previous_response_id`` and
``GET`` / ``DELETE /v1/responses/{id}``.

A stored response belongs to the tenant whose key made it: looked up with another tenant's
key it is not there (a 404 that says no more than an id nobody made), and its id is 96 random
bits, so guessing one finds nothing either. What is kept is the conversation up to and
including the answer (its messages' roles and texts, tool calls and results among them, never
token ids or K/V) and the answer as it was sent.

``MemoryResponses`` keeps them in this replica's memory: a restart forgets them, and another
replica does not see them; where the cache has Redis, ``redis_responses.RedisResponses`` keeps
them there instead, for every replica (both are a ``ResponseStore``).

Each tenant keeps at most ``max_per_tenant`` responses
and ``max_chars_per_tenant`` characters of conversation (a conversation may be as long as a
prompt may, ``[limits] max_prompt_chars``, so the count alone would let one tenant hold
gigabytes); past either, the tenant's least recently used are dropped (never the one just
kept). A response expires ``ttl_s`` after its last use, as
its blocks do (kvgate's TTLs slide), or after the TTL its request gave
(``prompt_cache_retention``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredResponse:
    """One kept response.

    Attributes:
        id: the response's id (``resp_...``).
        tenant: whose key made it.
        messages: the conversation up to and including the answer, as ``{role, content}``
            (the instructions left out: a request's own apply, as OpenAI's do).
        body: the response object as it was answered (``GET`` returns it).
        ttl_s: how long it is kept after its last use (None: until it is dropped for room).
        expires_at: when, on the store's clock (None: never).
    """

    id: str
    tenant: str
    messages: tuple[Mapping[str, str], ...]
    body: Mapping[str, object]
    ttl_s: float | None = None
    expires_at: float | None = None


class ResponseStore(Protocol):
    """Where ``POST /v1/responses`` keeps what it is asked to ``store``."""

    def put(self, *, id: str, tenant: str, messages: Sequence[Mapping[str, str]],
            body: Mapping[str, object], ttl_s: float | None = None) -> None: ...

    def get(self, tenant: str, id: str) -> StoredResponse | None: ...

    def delete(self, tenant: str, id: str) -> bool: ...

    def chars_of(self, tenant: str) -> int: ...


class MemoryResponses:
    """Stored responses in this process, per tenant, least recently used dropped first.

    Args:
        max_per_tenant: the most responses one tenant keeps.
        max_chars_per_tenant: the most characters of conversation (answers included) one
            tenant keeps.
        default_ttl_s: the TTL of a response whose request named none (None: no expiry).
        clock: the store's time (``time.monotonic``; tests pass a fake one).
    """

    def __init__(self, *, max_per_tenant: int, max_chars_per_tenant: int,
                 default_ttl_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_per_tenant < 1 or max_chars_per_tenant < 1:
            raise ValueError(f"max_per_tenant and max_chars_per_tenant must be >= 1, got "
                             f"{max_per_tenant} and {max_chars_per_tenant}")
        self._max = max_per_tenant
        self._max_chars = max_chars_per_tenant
        self._chars_by_tenant: dict[str, int] = {}
        self._default_ttl_s = default_ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._by_tenant: dict[str, OrderedDict[str, StoredResponse]] = {}

    def put(self, *, id: str, tenant: str, messages: Sequence[Mapping[str, str]],
            body: Mapping[str, object], ttl_s: float | None = None) -> None:
        """Keep a response (``ttl_s`` None: the store's default)."""
        ttl = self._default_ttl_s if ttl_s is None else ttl_s
        stored = StoredResponse(id=id, tenant=tenant, messages=tuple(messages), body=body,
                                ttl_s=ttl, expires_at=self._due(ttl))
        with self._lock:
            kept = self._by_tenant.setdefault(tenant, OrderedDict())
            self._forget(tenant, kept, id)
            kept[id] = stored
            self._chars_by_tenant[tenant] = self._chars_by_tenant.get(tenant, 0) + _chars(stored)
            while len(kept) > 1 and (len(kept) > self._max
                                     or self._chars_by_tenant[tenant] > self._max_chars):
                self._forget(tenant, kept, next(iter(kept)))

    def get(self, tenant: str, id: str) -> StoredResponse | None:
        """``tenant``'s response ``id``, its expiry refreshed; None if it has none such (another
        tenant's id included) or it expired."""
        with self._lock:
            kept = self._by_tenant.get(tenant)
            stored = None if kept is None else kept.get(id)
            if stored is None or kept is None:
                return None
            if stored.expires_at is not None and stored.expires_at <= self._clock():
                self._forget(tenant, kept, id)
                return None
            stored = replace(stored, expires_at=self._due(stored.ttl_s))
            kept[id] = stored
            kept.move_to_end(id)
            return stored

    def delete(self, tenant: str, id: str) -> bool:
        """Drop ``tenant``'s response ``id``; whether it had one (expired ones count as gone)."""
        with self._lock:
            kept = self._by_tenant.get(tenant)
            stored = None if kept is None else self._forget(tenant, kept, id)
        return stored is not None and (stored.expires_at is None
                                       or stored.expires_at > self._clock())

    def chars_of(self, tenant: str) -> int:
        """The characters of conversation ``tenant`` keeps now."""
        with self._lock:
            return self._chars_by_tenant.get(tenant, 0)

    def _forget(self, tenant: str, kept: OrderedDict[str, StoredResponse],
                id: str) -> StoredResponse | None:
        """Drop ``id`` from ``kept`` and its characters from the tenant's count (hold the
        lock)."""
        stored = kept.pop(id, None)
        if stored is not None:
            self._chars_by_tenant[tenant] -= _chars(stored)
        return stored

    def _due(self, ttl_s: float | None) -> float | None:
        return None if ttl_s is None else self._clock() + ttl_s


def chars_of_conversation(messages: Sequence[Mapping[str, Any]]) -> int:
    """What a response counts against its tenant's characters: its conversation's contents
    (the answer among them; the answer's copy in ``body`` is of the same size) and its tool
    calls as JSON."""
    return sum(len(message.get("content", ""))
               + (len(json.dumps(message["tool_calls"], separators=(",", ":")))
                  if "tool_calls" in message else 0)
               for message in messages)


def _chars(stored: StoredResponse) -> int:
    return chars_of_conversation(stored.messages)
