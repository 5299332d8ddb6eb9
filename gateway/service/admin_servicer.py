"""The ``kvgate.v1.Admin`` service: operators' view of every tenant (admin keys only).

Protobuf in, ``CacheAdmin`` calls through, protobuf out, as ``gateway.service.servicer`` does
for the ``Gateway`` service (the prompt and scope conversions are its); the two servicers are
the only modules that build the generated messages. Every RPC reaches these methods through
``gateway.service.dispatch``, admin key checked, and every error they raise becomes a status
there.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gateway.config.keys import Principal, tenant_id_problem
from gateway.core.admin_reports import (
    EngineReport,
    Evicted,
    PrefixInfo,
    SessionInfo,
    StatsReport,
)
from gateway.core.errors import InvalidRequest, NotFound
from gateway.core.fingerprint import Scope
from gateway.core.prompt_limits import check_prefix_size
from gateway.core.sessions import checked_session_id
from gateway.core.tags import checked_tag
from gateway.service.edge import EdgeLimits
from gateway.service.engine_slot import EngineSlot
from gateway.service.pb import kvgate_pb2 as pb
from gateway.service.servicer import prompt_input

if TYPE_CHECKING:
    from gateway.engine.engine import Engine

DEFAULT_LIST_LIMIT = 100
MAX_LIST_LIMIT = 1000
SHARED_OWNER = Scope.shared().owner


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


def engine_report(engine: Engine) -> EngineReport:
    """What the engine computes and has computed, for ``Stats`` (the cache does not know it)."""
    counters = engine.counters
    tails = engine.tail_counters
    return EngineReport(
        route=engine.route.name, route_reason=engine.route.reason, steps=counters.num_steps,
        prefill_tokens=counters.num_prefill_tokens, decode_tokens=counters.num_decode_tokens,
        max_requests_in_step=counters.max_sequences_in_step,
        dedup_waits=counters.num_dedup_waits, dtype=engine.dtype, device=engine.device,
        tail_hits=tails.num_hits, tail_tokens=tails.num_tokens_served,
        tail_bytes=tails.num_bytes)


def stats_response(stats: StatsReport) -> pb.StatsResponse:
    """``stats`` as the reply, store notes as strings (the message's notes are a map of
    strings); ``gateway.client`` reads it back into a ``StatsReport``."""
    engine = stats.engine
    return pb.StatsResponse(
        engine=None if engine is None else pb.EngineStats(
            route=engine.route, route_reason=engine.route_reason, steps=engine.steps,
            prefill_tokens=engine.prefill_tokens, decode_tokens=engine.decode_tokens,
            max_requests_in_step=engine.max_requests_in_step, dedup_waits=engine.dedup_waits,
            dtype=engine.dtype, device=engine.device, tail_hits=engine.tail_hits,
            tail_tokens=engine.tail_tokens, tail_bytes=engine.tail_bytes),
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


def evict_response(result: Evicted) -> pb.EvictResponse:
    return pb.EvictResponse(num_blocks=result.num_blocks, bytes_by_tier=result.bytes_by_tier)


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
        return stats_response(replace(admin.stats(), engine=engine_report(self._engines.get())))

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
