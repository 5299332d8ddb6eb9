"""The ``kvgate.v1`` services: protobuf in, engine records through, protobuf out.

This module and ``gateway.client`` are the only ones that see the generated messages
(``gateway.service.pb.kvgate_pb2``); below this line everything is ``gateway.core.requests``
records. What a protobuf cannot say is checked here, at the edge: sampling ranges, TTLs, list
limits, tool JSON. Everything about the prompt itself is checked by the engine's canonicalisation.

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
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gateway.cache.stats import CacheStats
from gateway.config.keys import Principal, tenant_id_problem
from gateway.core.admin_reports import PrefixInfo, SessionInfo
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest, NotFound
from gateway.core.fingerprint import Scope
from gateway.core.prompt_limits import (
    PromptLimits,
    PromptSize,
    check_prefix_size,
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
from gateway.service.pb import kvgate_pb2 as pb

if TYPE_CHECKING:
    from gateway.cache.admin import EvictResult
    from gateway.engine.engine import Engine

logger = logging.getLogger(__name__)

GATEWAY_SERVICE = pb.DESCRIPTOR.services_by_name["Gateway"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name

DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 1000
SHARED_OWNER = Scope.shared().owner

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


def admin_tenant(tenant: str, field_name: str, *, allow_shared: bool = False) -> str:
    """A tenant id sent in an Admin request, checked like a configured one.

    Args:
        tenant: as sent.
        field_name: the request field, for the message.
        allow_shared: accept ``shared``, the owner of the shared scope's blocks (listing and
            evicting them by owner).

    Raises:
        InvalidRequest: empty, too long, control characters, surrounding spaces, or reserved.
    """
    if allow_shared and tenant == SHARED_OWNER:
        return tenant
    problem = tenant_id_problem(tenant)
    if problem is not None:
        raise InvalidRequest(f"{field_name}: {problem}")
    return tenant


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
                           allow_lossy=message.cache.allow_lossy),
        deadline=deadline,
        priority=priority_of(message),
    )


# ---- records -> protobuf ------------------------------------------------------------------


def delta_message(delta: TokenDelta) -> pb.GenerateResponse:
    return pb.GenerateResponse(delta=pb.TokenDelta(text=delta.text, token_ids=delta.token_ids))


def usage_message(usage: Usage) -> pb.GenerateResponse:
    return pb.GenerateResponse(usage=pb.Usage(
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


def lookup_response(result: LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        cached_tokens_by_tier=result.cached_tokens_by_tier,
        num_prompt_blocks=result.num_prompt_blocks,
        diverges_at_block=result.diverges_at_block,
        diverges_at_token=result.diverges_at_token,
        text_around_divergence=result.text_around_divergence,
        lossy=result.lossy,
    )


def engine_stats(engine: Engine) -> pb.EngineStats:
    counters = engine.counters
    tails = engine.tail_counters
    return pb.EngineStats(
        route=engine.route.name, route_reason=engine.route.reason, steps=counters.num_steps,
        prefill_tokens=counters.num_prefill_tokens, decode_tokens=counters.num_decode_tokens,
        max_requests_in_step=counters.max_sequences_in_step,
        dedup_waits=counters.num_dedup_waits, dtype=engine.dtype, device=engine.device,
        tail_hits=tails.num_hits, tail_tokens=tails.num_tokens_served,
        tail_bytes=tails.num_bytes)


def stats_response(stats: CacheStats, engine: pb.EngineStats | None = None) -> pb.StatsResponse:
    return pb.StatsResponse(
        engine=engine,
        num_blocks=stats.num_blocks,
        num_namespaces=stats.num_namespaces,
        num_token_mismatches=stats.num_token_mismatches,
        num_remote_hits=stats.num_remote_hits,
        tiers=[
            pb.TierStats(
                name=t.name, num_blocks=t.num_blocks, used_bytes=t.used_bytes,
                budget_bytes=t.budget_bytes, hits=t.hits, inserts=t.inserts,
                refused=t.refused, promotions=t.promotions, demotions=t.demotions,
                load_failures=t.load_failures, recomputed_instead=t.recomputed_instead,
                evictions=t.evictions,
            )
            for t in stats.tiers
        ],
        stores=[
            pb.StoreStats(
                name=s.name, num_blocks=s.num_blocks, num_bytes=s.num_bytes, hits=s.hits,
                misses=s.misses, puts=s.puts, deletes=s.deletes, errors=s.errors,
                verification_failures=s.verification_failures, is_available=s.is_available,
                notes={key: str(value) for key, value in s.notes.items()},
            )
            for s in stats.stores
        ],
    )


def list_limit(requested: int) -> int:
    """A listing's ``limit`` as sent (0: the default).

    Raises:
        InvalidRequest: outside 1 to ``MAX_LIST_LIMIT``.
    """
    limit = requested or DEFAULT_LIST_LIMIT
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise InvalidRequest(f"limit must be 1 to {MAX_LIST_LIMIT} (0 for "
                             f"{DEFAULT_LIST_LIMIT}), got {requested}")
    return limit


def prefix_summary(summary: PrefixInfo) -> pb.PrefixSummary:
    return pb.PrefixSummary(
        tenant=summary.tenant, key_hex=summary.key_hex, num_blocks=summary.num_blocks,
        num_tokens=summary.num_tokens, num_bytes=summary.num_bytes, tiers=summary.tiers,
        age_s=summary.age_s, idle_s=summary.idle_s, num_hits=summary.num_hits,
        is_pinned=summary.is_pinned, preview=summary.preview, tags=summary.tags,
    )


def session_summary(summary: SessionInfo) -> pb.SessionSummary:
    return pb.SessionSummary(
        tenant=summary.tenant, session_id=summary.session_id, num_blocks=summary.num_blocks,
        num_bytes=summary.num_bytes, tail_tokens=summary.tail_tokens, idle_s=summary.idle_s,
        expires_in_s=summary.expires_in_s)


def evict_response(result: EvictResult) -> pb.EvictResponse:
    return pb.EvictResponse(num_blocks=result.num_blocks, bytes_by_tier=result.bytes_by_tier)


# ---- the services -------------------------------------------------------------------------


class GatewayServicer:
    """``kvgate.v1.Gateway``: Generate, Warm, Lookup, in the caller's own scope."""

    def __init__(self, engines: EngineSlot, limits: EdgeLimits) -> None:
        self._engines = engines
        self._limits = limits

    def Generate(
        self, request: pb.GenerateRequest, principal: Principal, context: Any
    ) -> Iterator[pb.GenerateResponse]:
        engine = self._engines.get()
        record = generate_request(request, principal, deadline=self._deadline(context),
                                  limits=self._limits)
        tag = tag_of(request.cache, "cache.tag")
        if tag is not None and record.cache.no_cache:
            raise InvalidRequest("cache.tag marks the blocks a request stores, and no_cache "
                                 "stores none: send one of them")
        admin = self._engines.admin() if tag is not None else None
        generation = Generation(engine.generate(record))
        if not context.add_callback(generation.cancel_unless_delivered):  # the call ended
            generation.cancel_unless_delivered()
        try:
            for item in generation:
                if isinstance(item, TokenDelta):
                    yield delta_message(item)
                else:
                    if admin is not None and tag is not None:  # the prompt's blocks are stored
                        admin.tag_prompt(record.prompt, record.scope, tag)
                    yield usage_message(item)
        finally:
            generation.cancel_unless_delivered()  # stopped early: the engine releases the blocks

    def Warm(
        self, request: pb.WarmRequest, principal: Principal, context: Any
    ) -> pb.WarmResponse:
        engine = self._engines.get()
        if request.pin:
            principal.require_admin("pinning (Warm with pin)")
        tag = tag_of(request)
        admin = self._engines.admin() if tag is not None else None
        record = WarmRequest(
            prompt=prompt_input(request.input, self._limits.prompt),
            scope=scope_for(principal, request.scope),
            pin=request.pin,
            ttl_s=ttl_seconds(request, self._limits),
            deadline=self._deadline(context),
        )
        handle = engine.start_warm(record)
        context.add_callback(handle.cancel)  # a client that goes away stops its warm
        result = handle.result()
        if admin is not None and tag is not None:
            admin.tag_prompt(record.prompt, record.scope, tag)
        return warm_response(result)

    def Lookup(
        self, request: pb.LookupRequest, principal: Principal, context: Any
    ) -> pb.LookupResponse:
        engine = self._engines.get()
        record = LookupRequest(prompt=prompt_input(request.input, self._limits.prompt),
                               scope=scope_for(principal, request.scope),
                               allow_lossy=request.allow_lossy)
        return lookup_response(engine.lookup(record))

    def _deadline(self, context: Any) -> float:
        """min(the client's deadline, the server's maximum), on ``time.monotonic``."""
        return deadline_within(self._limits, context.time_remaining())


class AdminServicer:
    """``kvgate.v1.Admin``: operators' view of every tenant (admin keys only): ``CacheAdmin``.

    Args:
        engines: where the engine is.
        limits: bounds on what a request may send.
        tenants: the tenants this gateway has keys for; a quota for any other name would never
            apply, so it is refused (None: not checked).
    """

    def __init__(self, engines: EngineSlot, limits: EdgeLimits | None = None, *,
                 tenants: frozenset[str] | None = None) -> None:
        self._engines = engines
        self._limits = limits or EdgeLimits()
        self._tenants = tenants

    def Stats(
        self, request: pb.StatsRequest, principal: Principal, context: Any
    ) -> pb.StatsResponse:
        admin = self._engines.admin()
        return stats_response(admin.stats(), engine_stats(self._engines.get()))

    def ListPrefixes(
        self, request: pb.ListPrefixesRequest, principal: Principal, context: Any
    ) -> pb.ListPrefixesResponse:
        limit = list_limit(request.limit)
        tenant = (admin_tenant(request.tenant, "tenant", allow_shared=True)
                  if request.HasField("tenant") else None)
        summaries = self._engines.admin().list_prefixes(tenant=tenant, limit=limit)
        return pb.ListPrefixesResponse(prefixes=[prefix_summary(s) for s in summaries])

    def Evict(
        self, request: pb.EvictRequest, principal: Principal, context: Any
    ) -> pb.EvictResponse:
        criteria = {
            name: getattr(request, name)
            for name in ("tenant", "prefix_text", "key_hex", "older_than_s", "tier", "tag")
            if request.HasField(name)
        }
        if "tenant" in criteria:
            admin_tenant(criteria["tenant"], "tenant", allow_shared=True)
        if "tag" in criteria:
            checked_tag(criteria["tag"])
        if "prefix_text" in criteria:
            check_prefix_size(criteria["prefix_text"], self._limits.prompt)
        if not criteria and not request.everything:
            raise InvalidRequest("name what to evict (tenant, prefix_text, key_hex, "
                                 "older_than_s, tier, tag) or set everything")
        if criteria and request.everything:
            raise InvalidRequest("`everything` evicts every block; send it without criteria")
        older = criteria.get("older_than_s")
        if older is not None and not (math.isfinite(older) and older >= 0):
            raise InvalidRequest(f"older_than_s must be a number of seconds >= 0, got {older}")
        result = self._engines.admin().evict(everything=request.everything, **criteria)
        return evict_response(result)

    def Pin(
        self, request: pb.PinRequest, principal: Principal, context: Any
    ) -> pb.PinResponse:
        return self._set_pinned(request, principal, pinned=True)

    def Unpin(
        self, request: pb.PinRequest, principal: Principal, context: Any
    ) -> pb.PinResponse:
        return self._set_pinned(request, principal, pinned=False)

    def _set_pinned(
        self, request: pb.PinRequest, principal: Principal, *, pinned: bool
    ) -> pb.PinResponse:
        if request.scope == pb.SCOPE_SHARED:
            if request.tenant:
                raise InvalidRequest("send `tenant` only with SCOPE_TENANT")
            scope = Scope.shared()
        elif request.scope in (pb.SCOPE_UNSPECIFIED, pb.SCOPE_TENANT):
            scope = Scope.of_tenant(admin_tenant(request.tenant, "tenant")
                                    if request.tenant else principal.tenant)
        else:
            raise InvalidRequest(f"unknown scope {request.scope}; use SCOPE_TENANT or "
                                 "SCOPE_SHARED")
        prompt = prompt_input(request.input, self._limits.prompt)
        return pb.PinResponse(num_blocks=self._engines.admin().set_pinned(prompt, scope, pinned))

    def SetQuota(
        self, request: pb.SetQuotaRequest, principal: Principal, context: Any
    ) -> pb.SetQuotaResponse:
        if not request.tenant:
            raise InvalidRequest("name the tenant whose quota to set")
        num_bytes = request.num_bytes if request.HasField("num_bytes") else None
        if num_bytes is not None and num_bytes < 0:
            raise InvalidRequest(f"num_bytes must be >= 0 (unset removes the quota), "
                                 f"got {num_bytes}")
        tenant = admin_tenant(request.tenant, "tenant")
        if self._tenants is not None and tenant not in self._tenants:
            raise NotFound(f"no tenant {tenant!r}: this gateway has keys for "
                           f"{sorted(self._tenants)}; a quota for another name would never "
                           "apply")
        self._engines.admin().set_quota(tenant, num_bytes)
        return pb.SetQuotaResponse()

    def Flush(
        self, request: pb.FlushRequest, principal: Principal, context: Any
    ) -> pb.EvictResponse:
        return evict_response(self._engines.admin().flush())

    def ListSessions(
        self, request: pb.ListSessionsRequest, principal: Principal, context: Any
    ) -> pb.ListSessionsResponse:
        limit = list_limit(request.limit)
        tenant = admin_tenant(request.tenant, "tenant") if request.HasField("tenant") else None
        sessions = self._engines.admin().sessions.list(tenant=tenant, limit=limit)
        return pb.ListSessionsResponse(sessions=[session_summary(s) for s in sessions])

    def ResetSession(
        self, request: pb.ResetSessionRequest, principal: Principal, context: Any
    ) -> pb.ResetSessionResponse:
        session_id = checked_session_id(request.session_id, "session_id")
        tenant = admin_tenant(request.tenant, "tenant") if request.HasField("tenant") else None
        dropped = self._engines.admin().sessions.reset(session_id, tenant=tenant)
        return pb.ResetSessionResponse(tenant=dropped.tenant, num_blocks=dropped.num_blocks,
                                       bytes_by_tier=dropped.bytes_by_tier,
                                       tail_bytes=dropped.tail_bytes)
