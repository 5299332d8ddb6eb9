"""Why a prompt did not reuse an earlier one's cached prefix, in the hosted APIs' terms.

Anthropic's ``diagnostics.previous_message_id`` and OpenAI's
``prompt_cache_options.comparison_response_id`` name an earlier request; the answer says where
this one's prompt first departs from it -- the model, the prompt-cache key, the tools, the
system prompt (``instructions``), or an earlier message (a conversation that only appended
turns departs nowhere) -- and about how many of the earlier prompt's cached tokens that costs.
The comparison is of the requests' structure, whatever the cache then held, as the hosted APIs
do.

What is kept of a request is its ``PromptShape``: a keyed digest of each part (BLAKE2b under a
key drawn when the gateway starts), never its text, and how many of its tokens it left in the
cache. Shapes belong to the tenant whose request made them: another tenant's id, an expired
one or one never made all read as unknown, and the answer says nothing about them.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from gateway.core.canonical import PromptInput

Part = Literal["model", "prompt_cache_key", "tools", "system", "messages"]
"""Where a prompt departs from an earlier one, in the order a prompt is compared."""


@dataclass(frozen=True, slots=True)
class PromptShape:
    """A request's prompt as digests: what a later request is compared with.

    Attributes:
        model: the model the request named.
        prompt_cache_key: the routing hint it sent (OpenAI's; empty digest for none).
        tools: its tool schemas, in order.
        system: its leading system messages.
        messages: each later message (role and content), in order.
    """

    model: bytes
    prompt_cache_key: bytes
    tools: bytes
    system: bytes
    messages: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a prompt first departs from an earlier one.

    Attributes:
        part: the first part that differs.
        first_message: for ``messages``, the index (after the system messages) of the first
            message that differs, or the length of the shorter conversation.
    """

    part: Part
    first_message: int = 0


@dataclass(frozen=True, slots=True)
class KeptShape:
    """A request's shape and how many of its prompt's tokens it left in the cache (read or
    stored: what a request sharing its prefix could have read)."""

    shape: PromptShape
    reusable_tokens: int


class ShapeDigests:
    """Digests of a prompt's parts under one key, so that shapes compare within a gateway and
    reveal nothing of the text to whoever reads its memory without that key."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key if key is not None else secrets.token_bytes(32)

    def shape(self, *, model: str, prompt: PromptInput,
              prompt_cache_key: str | None = None) -> PromptShape:
        messages = [dict(message) for message in prompt.messages or ()]
        num_system = next((i for i, message in enumerate(messages)
                           if message.get("role") != "system"), len(messages))
        return PromptShape(
            model=self._digest(model),
            prompt_cache_key=self._digest(prompt_cache_key or ""),
            tools=self._digest(list(prompt.tools or ())),
            system=self._digest(messages[:num_system]),
            messages=tuple(self._digest(message) for message in messages[num_system:]))

    def _digest(self, value: object) -> bytes:
        text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return hashlib.blake2b(text.encode("utf-8"), key=self._key, digest_size=16).digest()


def divergence(earlier: PromptShape, current: PromptShape) -> Divergence | None:
    """Where ``current`` first departs from ``earlier``; None where it only appends to it."""
    for part in ("model", "prompt_cache_key", "tools", "system"):
        if getattr(earlier, part) != getattr(current, part):
            return Divergence(part)
    shared = len(earlier.messages)
    if current.messages[:shared] == earlier.messages:
        return None
    first = next((i for i, (a, b) in enumerate(zip(earlier.messages, current.messages,
                                                   strict=False)) if a != b),
                 min(shared, len(current.messages)))
    return Divergence("messages", first)


def missed_tokens(kept: KeptShape, where: Divergence, prompt: PromptInput,
                  num_tokens: Callable[[PromptInput], int]) -> int:
    """About how many of the earlier prompt's cached tokens ``prompt`` could not read because
    of ``where``: all of them for a change before the messages, else those after the prompt
    cut before its first differing message (``num_tokens`` counts a prompt's tokens)."""
    if where.part != "messages":
        return kept.reusable_tokens
    messages = list(prompt.messages or ())
    num_system = next((i for i, message in enumerate(messages)
                       if message.get("role") != "system"), len(messages))
    cut = PromptInput(messages=messages[:num_system + where.first_message], tools=prompt.tools,
                      add_generation_prompt=False)
    common = num_tokens(cut) if cut.messages else 0
    return max(0, kept.reusable_tokens - common)


class KeptShapes:
    """The shapes of recent requests, by id, per tenant: at most ``max_per_tenant`` each (the
    least recently used dropped first), each forgotten ``ttl_s`` after its last use."""

    def __init__(self, *, max_per_tenant: int = 1000, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_per_tenant < 1 or ttl_s <= 0:
            raise ValueError("KeptShapes needs max_per_tenant >= 1 and ttl_s > 0")
        self._max = max_per_tenant
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: dict[str, OrderedDict[str, tuple[KeptShape, float]]] = {}

    def put(self, tenant: str, id: str, kept: KeptShape) -> None:
        with self._lock:
            shapes = self._kept.setdefault(tenant, OrderedDict())
            shapes[id] = (kept, self._clock() + self._ttl_s)
            shapes.move_to_end(id)
            while len(shapes) > self._max:
                shapes.popitem(last=False)

    def get(self, tenant: str, id: str) -> KeptShape | None:
        with self._lock:
            shapes = self._kept.get(tenant)
            found = shapes.get(id) if shapes is not None else None
            if found is None or shapes is None:
                return None
            kept, expires_at = found
            now = self._clock()
            if now >= expires_at:
                del shapes[id]
                return None
            shapes[id] = (kept, now + self._ttl_s)
            shapes.move_to_end(id)
            return kept


def anthropic_diagnostics(kept: KeptShape | None, where: Divergence | None,
                          missed: int) -> dict[str, object]:
    """Anthropic's ``diagnostics`` object of a request that named an earlier message (None
    ``kept``: unknown to this tenant)."""
    if kept is None:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    if where is None:
        return {"cache_miss_reason": None}
    return {"cache_miss_reason": {"type": f"{_ANTHROPIC_PART[where.part]}_changed",
                                  "cache_missed_input_tokens": missed}}


def responses_diagnostics(kept: KeptShape | None, where: Divergence | None,
                          missed: int) -> dict[str, object]:
    """OpenAI's ``prompt_cache_diagnostics`` of a response compared with an earlier one."""
    if kept is None:
        return {"type": "comparison_response_not_found"}
    if where is None:
        return {"type": "cache_hit"}
    return {"type": "cache_miss", "reason": _RESPONSES_REASON[where.part],
            "cache_missed_tokens": missed, "comparison_reusable_tokens": kept.reusable_tokens}


_ANTHROPIC_PART: Mapping[Part, str] = {
    "model": "model", "prompt_cache_key": "model", "tools": "tools", "system": "system",
    "messages": "messages"}
"""Anthropic's reasons (``model_changed`` ... ``messages_changed``); its requests carry no
cache key (their shapes' keys are all the empty one), so that row never applies."""

_RESPONSES_REASON: Mapping[Part, str] = {
    "model": "model_changed", "prompt_cache_key": "prompt_cache_key_changed",
    "tools": "tools_changed", "system": "input_changed", "messages": "input_changed"}
"""OpenAI's reasons: ``instructions`` are part of the input there."""


def compare(kept: KeptShape | None, current: PromptShape, prompt: PromptInput,
            num_tokens: Callable[[PromptInput], int]
            ) -> tuple[KeptShape | None, Divergence | None, int]:
    """The earlier shape (None: unknown), where ``current`` departs from it, and the tokens
    that cost."""
    if kept is None:
        return None, None, 0
    where = divergence(kept.shape, current)
    return kept, where, 0 if where is None else missed_tokens(kept, where, prompt, num_tokens)

