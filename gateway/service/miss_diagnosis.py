"""Why a prompt did not reuse an earlier one's cached prefix: one diagnosis for every surface.

A request names an earlier one -- Anthropic's ``diagnostics.previous_message_id``, OpenAI's
``prompt_cache_options.comparison_response_id``, gRPC ``Lookup``'s ``previous_request_id``
(and so ``kvgate explain``) -- and the answer (``Diagnosis``) says where this one's prompt first
departs from it -- the model, the prompt-cache key, the tools, the system prompt
(``instructions``), or an earlier message (a conversation that only appended turns departs
nowhere) --, the first block that may differ, and about how many of the earlier prompt's cached
tokens that costs. The comparison is of the requests' structure, whatever the cache then held,
as the hosted APIs do; each surface writes the one ``Diagnosis`` in its own shape
(``gateway.service.http.hosted_diagnostics``, ``gateway.service.servicer``).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from gateway.core.canonical import PromptInput
from gateway.core.tokens import TokenIds

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
    """A request's shape, how many of its prompt's tokens it left in the cache (read or
    stored: what a request sharing its prefix could have read), and a chained keyed digest of
    each of its prompt's full blocks (``ShapeDigests.blocks``: empty where not kept), which
    find the first block a later prompt changes exactly."""

    shape: PromptShape
    reusable_tokens: int
    blocks: tuple[bytes, ...] = ()


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

    def blocks(self, tokens: Sequence[int] | TokenIds, block_tokens: int) -> tuple[bytes, ...]:
        """A digest of each full block of ``tokens`` chained with the ones before it (8 bytes
        each), so that two prompts' digests are equal up to their first differing block."""
        data = np.asarray(tokens, dtype="<u4").tobytes()
        width = 4 * block_tokens
        chained = b""
        out = []
        for start in range(0, len(data) - width + 1, width):
            chained = hashlib.blake2b(chained + data[start:start + width], key=self._key,
                                      digest_size=8).digest()
            out.append(chained)
        return tuple(out)

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


def common_tokens(where: Divergence, prompt: PromptInput,
                  num_tokens: Callable[[PromptInput], int]) -> int:
    """How many of ``prompt``'s tokens come before the part where it departs from the earlier
    prompt: none for a change before the messages (the model, the key, the tools and the system
    prompt lead the rendered prompt), else those of the prompt cut before its first differing
    message (``num_tokens`` counts a prompt's tokens).

    NOTE: the parts are compared, not the tokens, so this is where the change may begin at the
    earliest: an edit at the end of a system prompt still counts from its start.
    """
    if where.part != "messages":
        return 0
    messages = list(prompt.messages or ())
    num_system = next((i for i, message in enumerate(messages)
                       if message.get("role") != "system"), len(messages))
    cut = PromptInput(messages=messages[:num_system + where.first_message], tools=prompt.tools,
                      add_generation_prompt=False)
    return num_tokens(cut) if cut.messages else 0


def missed_tokens(kept: KeptShape, where: Divergence, prompt: PromptInput,
                  num_tokens: Callable[[PromptInput], int]) -> int:
    """About how many of the earlier prompt's cached tokens ``prompt`` could not read because
    of ``where``: all of them for a change before the messages, else those after the prompt
    cut before its first differing message (``common_tokens``)."""
    if where.part != "messages":
        return kept.reusable_tokens
    return max(0, kept.reusable_tokens - common_tokens(where, prompt, num_tokens))


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    """What comparing a prompt with an earlier request found: every surface's answer (the
    hosted APIs' diagnostics over HTTP, ``Lookup``'s ``comparison`` over gRPC, ``kvgate
    explain``) is written from this one record.

    Attributes:
        is_known: whether the earlier request is known to the caller's tenant; when not, no
            other attribute says anything ("previous request unknown").
        where: where the prompt first departs from the earlier one; None where it only
            appends to it (or the earlier one is unknown).
        common_tokens: the prompt's tokens before that part (``common_tokens``).
        first_block: the first block of the prompt that differs from the earlier one's, from
            both prompts' block digests where the earlier one's were kept (else
            ``common_tokens // block_tokens``, the first the changed part may reach); None
            where nothing departs.
        reusable_tokens: the earlier prompt's tokens left in the cache (read or stored).
        missed_tokens: how many of those this prompt cannot read because of the change: those
            from ``first_block`` on where the blocks were compared, else about as many (those
            after the changed part's start).
    """

    is_known: bool
    where: Divergence | None = None
    common_tokens: int = 0
    first_block: int | None = None
    reusable_tokens: int = 0
    missed_tokens: int = 0


UNKNOWN = Diagnosis(is_known=False)
"""The answer about an id this tenant did not make, made and forgot, or never saw."""


def diagnose(kept: KeptShape | None, current: PromptShape, prompt: PromptInput,
             num_tokens: Callable[[PromptInput], int], *, block_tokens: int,
             compare_cache_key: bool = True,
             blocks_of: Callable[[], tuple[bytes, ...]] | None = None) -> Diagnosis:
    """``prompt`` (whose shape is ``current``) compared with the earlier request ``kept``
    (None: unknown to the caller).

    Args:
        num_tokens: counts a prompt's canonical tokens (run only where messages differ).
        block_tokens: tokens per cache block.
        compare_cache_key: compare the prompt-cache keys too (OpenAI's routing hint; a surface
            that has none, gRPC, compares the parts that enter the cache only).
        blocks_of: ``prompt``'s block digests (``ShapeDigests.blocks``, run only where it
            departs): with the kept request's, the first differing block is exact; without
            either, it is the first block the changed part may reach.
    """
    if kept is None:
        return UNKNOWN
    earlier = kept.shape
    if not compare_cache_key:
        earlier = replace(earlier, prompt_cache_key=current.prompt_cache_key)
    where = divergence(earlier, current)
    if where is None:
        return Diagnosis(is_known=True, reusable_tokens=kept.reusable_tokens)
    common = common_tokens(where, prompt, num_tokens)
    if kept.blocks and blocks_of is not None:
        first_block = first_difference(kept.blocks, blocks_of())
        missed = max(0, kept.reusable_tokens - first_block * block_tokens)
    else:
        first_block = common // block_tokens
        missed = (kept.reusable_tokens if where.part != "messages"
                  else max(0, kept.reusable_tokens - common))
    return Diagnosis(is_known=True, where=where, common_tokens=common,
                     first_block=first_block, reusable_tokens=kept.reusable_tokens,
                     missed_tokens=missed)


def first_difference(earlier: Sequence[bytes], current: Sequence[bytes]) -> int:
    """The index of the first block whose chained digests differ (the shorter's length where
    one prompt's blocks begin the other's)."""
    return next((i for i, (a, b) in enumerate(zip(earlier, current, strict=False)) if a != b),
                min(len(earlier), len(current)))


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
