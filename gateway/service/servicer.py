"""The ``kvgate.v1.Gateway`` service: protobuf in, engine records through, protobuf out.

This module, ``admin_servicer`` (the ``Admin`` service) and ``gateway.client`` are the only ones
that see the generated messages (``gateway.service.pb.kvgate_pb2``); below this line everything
is ``gateway.core.requests`` records. What a protobuf cannot say is checked here, at the edge:
sampling ranges, TTLs, tool JSON, ids. Everything about the prompt itself is checked by the
engine's canonicalisation.

Every RPC reaches these methods through ``gateway.service.dispatch`` (authenticated and
admitted before it took a thread; the principal is an argument of every method, so no method can
forget it), and every error they raise becomes a status there.

The checks the OpenAI-compatible HTTP front shares (TTL and deadline bounds, prompt size, the
cache scope of a key, the cancellation rule of a generation) live in ``gateway.service.edge``.

Client disconnects reach the engine through ``context.add_callback``: a generation stops, and
releases its blocks, when its caller goes away (``edge.Generation``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any

from gateway.config.keys import Principal
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest
from gateway.core.fingerprint import Scope
from gateway.core.prompt_limits import (
    PromptLimits,
    PromptSize,
    check_prompt_size,
)
from gateway.core.requests import (
    CacheOptions,
    GenerateRequest,
    LookupRequest,
    LookupResult,
    SamplingParams,
    TokenDelta,
    Usage,
    WarmRequest,
    WarmResult,
    priority_problem,
)
from gateway.core.sessions import checked_session_id, session_use_problem
from gateway.core.tags import checked_tag
from gateway.service.edge import (
    DEFAULT_PROMPT_LIMITS,
    EdgeLimits,
    Generation,
    check_num_tools,
    checked_ttl,
    deadline_within,
    scope_of,
)
from gateway.service.engine_slot import EngineSlot
from gateway.service.miss_diagnosis import Diagnosis
from gateway.service.pb import kvgate_pb2 as pb
from gateway.service.prompt_comparisons import PromptComparisons, new_request_id

logger = logging.getLogger(__name__)

GATEWAY_SERVICE = pb.DESCRIPTOR.services_by_name["Gateway"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name


_PROMPT_PARTS = {
    "model": pb.PROMPT_PART_MODEL,
    "prompt_cache_key": pb.PROMPT_PART_PROMPT_CACHE_KEY,
    "tools": pb.PROMPT_PART_TOOLS,
    "system": pb.PROMPT_PART_SYSTEM,
    "messages": pb.PROMPT_PART_MESSAGES,
}

_REQUEST_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""What an id this gateway gives looks like (``gen_``, ``msg_``, ``resp_`` and hex), with room."""

_FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "eos": pb.FINISH_REASON_EOS,
    "cancelled": pb.FINISH_REASON_CANCELLED,
    "deadline": pb.FINISH_REASON_DEADLINE,
}


# ---- protobuf -> records ------------------------------------------------------------------


def prompt_input(message: pb.PromptInput, limits: PromptLimits = DEFAULT_PROMPT_LIMITS
                 ) -> PromptInput:
    """The prompt record of ``message``; fields left empty are "not sent".

    Its size is checked first (``gateway.core.prompt_limits``): nothing is parsed, rendered or
    tokenised for a prompt over ``limits``.

    Raises:
        InvalidRequest: too many characters, messages or tools, or a tool schema that is not
            a JSON object.
    """
    check_prompt_size(PromptSize(
        num_chars=(len(message.prompt) + sum(len(m.role) + len(m.content)
                                             for m in message.messages)
                   + sum(len(tool) for tool in message.tools)),
        num_messages=len(message.messages)), limits)
    check_num_tools(len(message.tools))
    return PromptInput(
        messages=[{"role": m.role, "content": m.content} for m in message.messages] or None,
        prompt=message.prompt if message.HasField("prompt") else None,
        token_ids=list(message.token_ids) or None,
        tools=[_tool_schema(i, text) for i, text in enumerate(message.tools)] or None,
        add_generation_prompt=(message.add_generation_prompt
                               if message.HasField("add_generation_prompt") else True),
    )


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _tool_schema(index: int, text: str) -> Mapping[str, object]:
    try:
        schema = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidRequest(
            f"tools[{index}] is not valid JSON ({detail}); each tool is one JSON object, "
            "written as a string"
        ) from None
    if not isinstance(schema, dict):
        raise InvalidRequest(
            f"tools[{index}] is a JSON {type(schema).__name__}; each tool must be a JSON object"
        )
    return schema


def sampling_params(message: pb.SamplingParams) -> SamplingParams:
    """The sampling record of ``message``; unset fields take ``SamplingParams``' defaults.

    Raises:
        InvalidRequest: a field is out of range (every such field is named).
    """
    defaults = SamplingParams()
    params = SamplingParams(
        max_tokens=message.max_tokens if message.HasField("max_tokens") else defaults.max_tokens,
        temperature=(message.temperature if message.HasField("temperature")
                     else defaults.temperature),
        top_p=message.top_p if message.HasField("top_p") else defaults.top_p,
        top_k=message.top_k if message.HasField("top_k") else defaults.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
    )
    problems = params.problems()
    if problems:
        raise InvalidRequest("invalid sampling: " + "; ".join(problems))
    return params


def priority_of(message: pb.GenerateRequest) -> int:
    """``message.priority`` checked (0 when unset: vLLM's default).

    Raises:
        InvalidRequest: outside ``MIN_PRIORITY``..``MAX_PRIORITY`` (the message says the range).
    """
    if not message.HasField("priority"):
        return 0
    problem = priority_problem(message.priority)
    if problem is not None:
        raise InvalidRequest(problem)
    return message.priority


def tag_of(message: Any, field_name: str = "tag") -> str | None:
    """``message.tag`` checked (``gateway.core.tags``; None when unset).

    Raises:
        InvalidRequest: not a valid tag (the message says what is accepted).
    """
    return checked_tag(message.tag, field_name) if message.HasField("tag") else None


def session_of(cache: pb.CacheOptions) -> str | None:
    """``cache.session_id`` checked (``gateway.core.sessions``; None when unset).

    Raises:
        InvalidRequest: not a session id, or sent with ``no_cache`` or in the shared scope.
    """
    if not cache.HasField("session_id"):
        return None
    session_id = checked_session_id(cache.session_id, "cache.session_id")
    problem = session_use_problem(is_shared=cache.scope == pb.SCOPE_SHARED,
                                  no_cache=cache.no_cache)
    if problem is not None:
        raise InvalidRequest(f"cache.session_id: {problem}")
    return session_id


def ttl_seconds(message: Any, limits: EdgeLimits) -> float | None:
    """``message.ttl_s`` checked against ``limits`` (None when unset)."""
    return checked_ttl(message.ttl_s if message.HasField("ttl_s") else None, limits)


def scope_for(principal: Principal, scope: int) -> Scope:
    """The cache scope of a call: the key's tenant, or shared (admin keys only).

    Raises:
        PermissionDenied: the shared scope without an admin key.
        InvalidRequest: an unknown scope value.
    """
    if scope not in (pb.SCOPE_UNSPECIFIED, pb.SCOPE_TENANT, pb.SCOPE_SHARED):
        raise InvalidRequest(f"unknown scope {scope}; use SCOPE_TENANT or SCOPE_SHARED")
    return scope_of(principal, is_shared=scope == pb.SCOPE_SHARED)


def generate_request(
    message: pb.GenerateRequest, principal: Principal, *, deadline: float | None,
    limits: EdgeLimits,
) -> GenerateRequest:
    """The engine's request for a ``Generate`` call."""
    return GenerateRequest(
        prompt=prompt_input(message.input, limits.prompt),
        scope=scope_for(principal, message.cache.scope),
        sampling=sampling_params(message.sampling),
        cache=CacheOptions(no_cache=message.cache.no_cache,
                           ttl_s=ttl_seconds(message.cache, limits),
                           session_id=session_of(message.cache),
                           allow_lossy=message.cache.allow_lossy,
                           tag=tag_of(message.cache, "cache.tag")),
        deadline=deadline,
        priority=priority_of(message),
    )


# ---- records -> protobuf ------------------------------------------------------------------


def delta_message(delta: TokenDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(delta=pb.TokenDelta(text=delta.text, token_ids=delta.token_ids))


def usage_message(usage: Usage, request_id: str = "") -> pb.GenerateResponse:
    return pb.GenerateResponse(usage=pb.Usage(
        request_id=request_id,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.cached_tokens,
        cached_tokens_by_tier=usage.cached_tokens_by_tier,
        completion_tokens=usage.completion_tokens,
        ttft_ms=usage.ttft_ms,
        total_ms=usage.total_ms,
        finish_reason=_FINISH_REASONS.get(usage.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
        lossy=usage.lossy,
    ))


def warm_response(result: WarmResult) -> pb.WarmResponse:
    return pb.WarmResponse(
        prompt_tokens=result.prompt_tokens,
        num_blocks=result.num_blocks,
        num_new_blocks=result.num_new_blocks,
        num_cached_blocks=result.num_cached_blocks,
        stored_bytes=result.stored_bytes,
        elapsed_ms=result.elapsed_ms,
    )


def previous_request_id(request: pb.LookupRequest, prompt: PromptInput) -> str | None:
    """``request.previous_request_id`` checked (None when unset).

    Raises:
        InvalidRequest: not an id this gateway could have given, or sent with a prompt that is
            not a chat (``messages``), whose parts cannot be told apart.
    """
    if not request.HasField("previous_request_id"):
        return None
    earlier = request.previous_request_id
    if _REQUEST_ID.fullmatch(earlier) is None:
        raise InvalidRequest("previous_request_id must be an id this gateway gave: a "
                             "Generate's usage.request_id (gen_...), a /v1/messages id (msg_...) "
                             "or a /v1/responses id (resp_...); 1 to 128 of A-Z a-z 0-9 _ -")
    if prompt.messages is None:
        raise InvalidRequest("previous_request_id compares the parts of a chat (tools, system "
                             "messages, turns): send the prompt as `messages`, not as raw text "
                             "or token ids")
    return earlier


def prompt_comparison(found: Diagnosis) -> pb.PromptComparison:
    """``Diagnosis`` as gRPC says it (nothing but ``previous_known`` for an unknown id)."""
    if not found.is_known:
        return pb.PromptComparison(previous_known=False)
    where = found.where
    return pb.PromptComparison(
        previous_known=True,
        changed_part=(_PROMPT_PARTS[where.part] if where is not None
                      else pb.PROMPT_PART_UNSPECIFIED),
        first_changed_message=(where.first_message if where is not None
                               and where.part == "messages" else None),
        common_tokens=found.common_tokens, first_differing_block=found.first_block,
        previous_cached_tokens=found.reusable_tokens, missed_tokens=found.missed_tokens)


def lookup_response(result: LookupResult,
                    comparison: pb.PromptComparison | None = None) -> pb.LookupResponse:
    return pb.LookupResponse(
        comparison=comparison,
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        cached_tokens_by_tier=result.cached_tokens_by_tier,
        num_prompt_blocks=result.num_prompt_blocks,
        diverges_at_block=result.diverges_at_block,
        diverges_at_token=result.diverges_at_token,
        text_around_divergence=result.text_around_divergence,
        lossy=result.lossy,
    )


# ---- the services -------------------------------------------------------------------------


class GatewayServicer:
    """``kvgate.v1.Gateway``: Generate, Warm, Lookup, in the caller's own scope.

    Every Generate of a chat keeps its prompt's shape (keyed digests, ``prompt_comparisons``)
    under the ``request_id`` its usage carries, so that a later Lookup can name it; the HTTP
    front keeps its Messages and Responses ids in the same ``comparisons``.
    """

    def __init__(self, engines: EngineSlot, limits: EdgeLimits,
                 comparisons: PromptComparisons) -> None:
        self._engines = engines
        self._limits = limits
        self._comparisons = comparisons

    def Generate(
        self, request: pb.GenerateRequest, principal: Principal, context: Any
    ) -> Iterator[pb.GenerateResponse]:
        engine = self._engines.get()
        record = generate_request(request, principal, deadline=self._deadline(context),
                                  limits=self._limits)
        request_id = ""
        keep = None
        if record.prompt.messages is not None:
            request_id = new_request_id()
            keep = self._comparisons.keeper(record.scope.owner, self._comparisons.shape(
                model=engine.model_name, prompt=record.prompt), record.prompt, engine)
        generation = Generation(engine.generate(record))
        if not context.add_callback(generation.cancel_unless_delivered):  # the call ended
            generation.cancel_unless_delivered()
        try:
            for item in generation:
                if isinstance(item, TokenDelta):
                    yield delta_message(item)
                else:
                    if keep is not None:
                        keep(request_id, item)
                    yield usage_message(item, request_id)
        finally:
            generation.cancel_unless_delivered()  # stopped early: the engine releases the blocks

    def Warm(
        self, request: pb.WarmRequest, principal: Principal, context: Any
    ) -> pb.WarmResponse:
        engine = self._engines.get()
        if request.pin:
            principal.require_admin("pinning (Warm with pin)")
        record = WarmRequest(
            prompt=prompt_input(request.input, self._limits.prompt),
            scope=scope_for(principal, request.scope),
            pin=request.pin,
            ttl_s=ttl_seconds(request, self._limits),
            deadline=self._deadline(context),
            tag=tag_of(request),
        )
        handle = engine.start_warm(record)
        context.add_callback(handle.cancel)  # a client that goes away stops its warm
        return warm_response(handle.result())

    def Lookup(
        self, request: pb.LookupRequest, principal: Principal, context: Any
    ) -> pb.LookupResponse:
        engine = self._engines.get()
        record = LookupRequest(prompt=prompt_input(request.input, self._limits.prompt),
                               scope=scope_for(principal, request.scope),
                               allow_lossy=request.allow_lossy)
        earlier = previous_request_id(request, record.prompt)
        result = engine.lookup(record)
        if earlier is None:
            return lookup_response(result)
        # NOTE: gRPC has no prompt-cache key (OpenAI's routing hint, never part of a block
        # key): an earlier Responses request's key is not a change here.
        found = self._comparisons.diagnose(
            record.scope.owner, earlier,
            self._comparisons.shape(model=engine.model_name, prompt=record.prompt),
            record.prompt, engine, compare_cache_key=False)
        return lookup_response(result, prompt_comparison(found))

    def _deadline(self, context: Any) -> float:
        """min(the client's deadline, the server's maximum), on ``time.monotonic``."""
        return deadline_within(self._limits, context.time_remaining())
