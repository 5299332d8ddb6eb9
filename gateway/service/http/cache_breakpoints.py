"""Anthropic's prompt-caching breakpoints (``cache_control``) as kvgate's TTLs.

kvgate caches every full block of every prompt whatever is marked (docs/design.md, "Identity
of a prefix"), so a breakpoint does not decide *whether* a prefix is kept but *for how long*:
the blocks up to a breakpoint are kept for its TTL after their last use, a read refreshing it
(kvgate's TTLs slide, as Anthropic's 5-minute one does).

- ``{"type": "ephemeral"}`` is 5 minutes (300 s), ``"ttl": "1h"`` one hour (3,600 s); any
  other type or TTL is refused.
- At most ``MAX_BREAKPOINTS`` (4) per request, a top-level ``cache_control`` (automatic
  caching: a breakpoint on the prompt's last block) counted among them.
- A longer TTL may not follow a shorter one (Anthropic's rule: a 1-hour breakpoint after a
  5-minute one is a 400): a prefix's blocks are only useful with the blocks before them.

One request stores its blocks with one TTL (``CacheOptions.ttl_s``), the last breakpoint's;
the blocks after it get it too (they are useless once their prefix expires). Where a 1-hour
breakpoint comes before a 5-minute one, the prompt up to the 1-hour one is warmed first, with
its TTL (``warm_longer_prefix``), so that the generation reads those blocks and stores only
the rest, for 5 minutes. NOTE: a block keeps the TTL it was stored with: a block first stored
under a 5-minute breakpoint and later read under a 1-hour one stays a 5-minute block (each
read still refreshes it). Without any breakpoint the blocks are kept as the hosted API keeps a
prefix, 5 minutes after its last use (``edge.hosted_api_ttl``; the gateway's own
``[engine] default_ttl_s`` where its ``max_ttl_s`` is shorter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest
from gateway.core.fingerprint import Scope
from gateway.core.requests import LookupRequest, LookupResult, WarmRequest, WarmResult
from gateway.core.tokens import TokenIds
from gateway.service.edge import HOSTED_API_TTL_S, EdgeLimits, checked_ttl, hosted_api_ttl
from gateway.service.http.errors import InvalidParam
from gateway.service.http.json_fields import type_name

EphemeralTtl = Literal["5m", "1h"]

TTL_S: dict[EphemeralTtl, float] = {"5m": 300.0, "1h": 3600.0}
"""Anthropic's cache lifetimes in seconds; ``5m`` when a breakpoint names none."""

MAX_BREAKPOINTS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Breakpoint:
    """One ``cache_control``: where it is and how long its prefix is kept.

    Attributes:
        ttl: ``5m`` or ``1h``.
        where: the marked field as the client wrote it (``system.1.cache_control``).
        message: the index of the marked block's message in the rendered prompt (the system
            message first, where there is one); None for the top-level ``cache_control``,
            which marks the prompt's end.
        num_parts: the text blocks of that message up to and including the marked one.
    """

    ttl: EphemeralTtl
    where: str
    message: int | None = None
    num_parts: int = 0


class PrefixEngine(Protocol):
    """What ``warm_longer_prefix`` needs of the engine (``Engine``'s public calls)."""

    def prompt_tokens(self, prompt: PromptInput) -> TokenIds: ...

    def lookup(self, request: LookupRequest) -> LookupResult: ...

    def warm(self, request: WarmRequest) -> WarmResult: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class CachePlan:
    """How long a request's blocks are kept.

    Attributes:
        ttl: the TTL the generation stores its blocks with (None: the gateway's own).
        longer: the 1-hour prefix to warm before a generation whose blocks get 5 minutes:
            the prompt cut after the last 1-hour breakpoint (None: nothing to warm).
    """

    ttl: EphemeralTtl | None = None
    longer: PromptInput | None = None

    @property
    def ttl_s(self) -> float | None:
        """The generation's TTL in seconds (None: the gateway's own)."""
        return None if self.ttl is None else TTL_S[self.ttl]


def parse_cache_control(value: object, where: str) -> EphemeralTtl:
    """The TTL a ``cache_control`` object asks for.

    Raises:
        InvalidParam: not ``{"type": "ephemeral"}`` with an optional ``ttl`` of ``5m`` or
            ``1h``.
    """
    if not isinstance(value, dict):
        raise InvalidParam(where, f"{where}: must be an object "
                                  f"{{\"type\": \"ephemeral\"}}, got {type_name(value)}")
    if value.get("type") != "ephemeral":
        raise InvalidParam(f"{where}.type", f"{where}.type: the only cache type is "
                                            f"\"ephemeral\", got {value.get('type')!r}")
    unknown = sorted(set(value) - {"type", "ttl"})
    if unknown:
        raise InvalidParam(where, f"{where}: unknown keys {unknown}; a cache_control is "
                                  "{type: \"ephemeral\", ttl: \"5m\" | \"1h\"}")
    ttl = value.get("ttl")
    if ttl is None:
        return "5m"
    if ttl == "5m" or ttl == "1h":
        return ttl  # type: ignore[no-any-return]
    raise InvalidParam(f"{where}.ttl", f"{where}.ttl: must be \"5m\" or \"1h\", got {ttl!r}")


def plan_of(breakpoints: Sequence[Breakpoint], messages: Sequence[dict[str, str]],
            parts: Sequence[Sequence[str]], limits: EdgeLimits, *,
            tools: Sequence[Mapping[str, object]] | None = None) -> CachePlan:
    """The TTLs of a prompt's breakpoints, in prompt order (the top-level one last).

    Args:
        breakpoints: every ``cache_control`` of the request, in the order of the prompt.
        messages: the rendered prompt's messages (``{role, content}``).
        parts: each message's text blocks (its content is them joined by ``"\\n"``).
        limits: the edge's TTL bound (a gateway whose ``max_ttl_s`` is under an hour refuses
            ``1h``).
        tools: the prompt's tool schemas (the chat template renders them into the prefix, so
            the cut prompt carries them too).

    Raises:
        InvalidParam: more than ``MAX_BREAKPOINTS``, a longer TTL after a shorter one, or a
            TTL over the gateway's limit.
    """
    if len(breakpoints) > MAX_BREAKPOINTS:
        raise InvalidParam(breakpoints[MAX_BREAKPOINTS].where,
                           f"a request may have at most {MAX_BREAKPOINTS} blocks with "
                           f"cache_control, found {len(breakpoints)} (a top-level cache_control "
                           "counts as one)")
    for earlier, later in zip(breakpoints, breakpoints[1:], strict=False):
        if TTL_S[later.ttl] > TTL_S[earlier.ttl]:
            raise InvalidParam(later.where, f"{later.where}: a ttl of {later.ttl} may not "
                               f"follow one of {earlier.ttl} ({earlier.where}): a longer-lived "
                               "breakpoint must come before shorter-lived ones")
    for mark in breakpoints:
        try:
            checked_ttl(TTL_S[mark.ttl], limits)
        except InvalidRequest as exc:
            raise InvalidParam(f"{mark.where}.ttl", f"{mark.where}.ttl: {exc}") from None
    if not breakpoints:
        return CachePlan(ttl="5m") if hosted_api_ttl(limits) == HOSTED_API_TTL_S else CachePlan()
    last = breakpoints[-1]
    longer = [mark for mark in breakpoints if TTL_S[mark.ttl] > TTL_S[last.ttl]]
    if not longer or longer[-1].message is None:
        return CachePlan(ttl=last.ttl)
    cut = longer[-1]
    assert cut.message is not None
    head = [dict(message) for message in messages[:cut.message]]
    marked = dict(messages[cut.message],
                  content="\n".join(parts[cut.message][:cut.num_parts]))
    return CachePlan(ttl=last.ttl,
                     longer=PromptInput(messages=[*head, marked], tools=tools,
                                        add_generation_prompt=False))


def warm_longer_prefix(engine: PrefixEngine, prompt: PromptInput, plan: CachePlan, *,
                       scope: Scope, deadline: float | None) -> int:
    """Store the prompt's blocks up to its last 1-hour breakpoint for an hour, before a
    generation that stores the rest for 5 minutes; the prompt tokens the warm stored.

    The breakpoint's token position is where the tokens of the prompt cut after the marked
    block part from the whole prompt's (a chat template closes the cut message there). Only
    the whole prompt's own tokens are warmed (as token ids), so the blocks are exactly those
    the generation then reads. Runs on a worker thread: it tokenises twice and waits.

    Args:
        engine: the engine the generation runs on.
        prompt: the whole prompt.
        plan: its plan, with ``plan.longer`` set.
        scope: the request's cache scope.
        deadline: the request's.

    Raises:
        GatewayError: the warm was refused or failed (a full queue, the deadline...).
    """
    assert plan.longer is not None
    whole = engine.prompt_tokens(prompt)
    cut = engine.prompt_tokens(plan.longer)
    num_common = 0
    for mine, theirs in zip(whole, cut, strict=False):
        if mine != theirs:
            break
        num_common += 1
    if num_common == 0:
        return 0
    prefix = PromptInput(token_ids=[int(token) for token in whole[:num_common]])
    probe = LookupRequest(prompt=prefix, scope=scope)
    before = engine.lookup(probe).cached_tokens
    engine.warm(WarmRequest(prompt=prefix, scope=scope, ttl_s=TTL_S["1h"],
                            deadline=deadline))
    return max(0, engine.lookup(probe).cached_tokens - before)
