"""A typed, synchronous Python client for ``kvgate.v1``, for app backends and ``kvgate generate``.

    with KvgateClient("127.0.0.1", 50051, api_key) as client:
        for item in client.generate("Why is the sky blue?", max_tokens=64):
            if isinstance(item, TokenDelta):
                print(item.text, end="", flush=True)
        text, usage = client.generate_text(messages=[{"role": "user", "content": "Hi"}])

Results are plain records (``gateway.core.requests``' ``TokenDelta``, ``Usage``, ``WarmResult``,
``LookupResult``; this module's records for the Admin service), never protobuf messages.

Every call has a deadline (``timeout_s``, per call or the client's default). A call that fails
with UNAVAILABLE (the server is loading its model, draining, or restarting) is retried with
exponential backoff within that deadline -- a generation only if nothing of it was received
yet; no other status is retried. Failures raise a ``KvgateError`` subclass carrying the status
code and the server's message::

    KvgateError
     ├── Unauthenticated      UNAUTHENTICATED: no key, or an unknown one
     ├── PermissionDenied     PERMISSION_DENIED: an admin-only call with a tenant key
     ├── InvalidArgument      INVALID_ARGUMENT: the request can never succeed as sent
     ├── ResourceExhausted    RESOURCE_EXHAUSTED: queue full / message too large
     ├── DeadlineExceeded     DEADLINE_EXCEEDED
     ├── Unavailable          UNAVAILABLE (after the retries)
     │    └── NotGrpc         the address answered in HTTP/1.x: not a gRPC port (not retried)
     ├── Cancelled            CANCELLED
     └── InternalError        INTERNAL and anything else

Like the server, the client refuses to send a key in the clear to a host that is not loopback
unless told to (``allow_insecure=True``).
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import grpc

from gateway.core.addresses import is_loopback
from gateway.core.admin_reports import EngineReport as EngineReport
from gateway.core.admin_reports import Evicted as Evicted
from gateway.core.admin_reports import PrefixInfo as PrefixInfo
from gateway.core.admin_reports import SessionInfo as SessionInfo
from gateway.core.admin_reports import SessionReset as SessionReset
from gateway.core.admin_reports import StatsReport as StatsReport
from gateway.core.admin_reports import StoreReport as StoreReport
from gateway.core.admin_reports import TierReport as TierReport
from gateway.core.requests import FinishReason, LookupResult, TokenDelta, Usage, WarmResult
from gateway.core.requests import PromptComparison as PromptComparison
from gateway.service.pb import kvgate_pb2 as pb
from gateway.service.pb import kvgate_pb2_grpc as pb_grpc

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50051
DEFAULT_TIMEOUT_S = 120.0

_FINISH_REASONS: dict[int, FinishReason] = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_EOS: "eos",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_DEADLINE: "deadline",
}

T = TypeVar("T")


# ---- errors --------------------------------------------------------------------------------


class KvgateError(Exception):
    """A call that ended with a status other than OK.

    Attributes:
        code: the gRPC status code.
        details: the server's message (what was wrong and what would be accepted).
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class Unauthenticated(KvgateError):
    """No API key, or one the gateway does not know."""


class PermissionDenied(KvgateError):
    """The key may not do this (an admin RPC, or the shared scope, with a tenant key)."""


class InvalidArgument(KvgateError):
    """The request can never succeed as sent; the message says what to change."""


class NotFound(KvgateError):
    """An admin call named a tenant or a block the gateway does not have; nothing changed."""


class ResourceExhausted(KvgateError):
    """Too many requests waiting, or a message too large; retry later or send less."""


class DeadlineExceeded(KvgateError):
    """The call ran past its deadline."""


class Unavailable(KvgateError):
    """The gateway is loading or draining; retried automatically, then raised."""


class NotGrpc(Unavailable):
    """The address answered, but in HTTP/1.x rather than gRPC's HTTP/2: an HTTP port, such as
    kvgate's OpenAI-compatible API (8000) or its metrics port, instead of the gRPC one."""


class Cancelled(KvgateError):
    """The call was cancelled."""


class InternalError(KvgateError):
    """A fault inside the gateway (its log has the details)."""


_ERROR_OF_CODE: dict[Any, type[KvgateError]] = {
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.CANCELLED: Cancelled,
}


_NOT_HTTP2 = re.compile(r"Failed parsing HTTP/2|http1\.x server")
"""What gRPC core says of a server that answered a connection in something other than HTTP/2
("... (Expected SETTINGS frame as the first frame, got frame type 79)": the ``O`` of
``HTTP/1.1 400``, read as a frame header)."""


def error_of(exc: grpc.RpcError, target: str | None = None) -> KvgateError:
    """The ``KvgateError`` for a failed call to ``target`` (``host:port``, for the message)."""
    code = exc.code()
    details = exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and _NOT_HTTP2.search(details):
        where = target or "the address"
        return NotGrpc(code, f"{where} answered HTTP/1.x, not gRPC: is that kvgate's HTTP API "
                             "port (or its metrics port)? kvgate's gRPC service listens on "
                             "[server] port (kvgate --port; 50051 by default)")
    return _ERROR_OF_CODE.get(code, InternalError)(code, details)


# ---- admin records -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Retries of UNAVAILABLE: at most ``max_attempts`` calls, backoff doubling with jitter."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0

    def backoff_s(self, attempt: int) -> float:
        """Sleep before attempt ``attempt + 1`` (``attempt`` counts from 1)."""
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * 2 ** (attempt - 1))
        return random.uniform(ceiling / 2, ceiling)


# ---- the client ----------------------------------------------------------------------------


class KvgateClient:
    """A connection to one gateway.

    Args:
        host, port: the gateway's address.
        api_key: the key sent as ``authorization: Bearer <key>`` (None sends none).
        tls: use TLS (``root_certificates``: PEM of the CA, default the system's).
        timeout_s: default deadline of every call, retries included.
        retry: how UNAVAILABLE is retried.
        allow_insecure: send the key in the clear to a host that is not loopback.
        admin_port: where the Admin service listens when the gateway serves it on a listener
            of its own (``[server] admin_port``), on the same host; None: on ``port``.

    Raises:
        ValueError: a key would be sent in the clear to a remote host.
    """

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        api_key: str | None = None,
        *,
        tls: bool = False,
        root_certificates: bytes | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = None,
        allow_insecure: bool = False,
        options: Sequence[tuple[str, Any]] = (),
        admin_port: int | None = None,
    ) -> None:
        if api_key is not None and not tls and not is_loopback(host) and not allow_insecure:
            raise ValueError(
                f"refusing to send an API key in the clear to {host}; use tls=True (or "
                "allow_insecure=True behind a trusted TLS proxy)"
            )
        def target(at: int) -> str:
            bracketed = ":" in host and not host.startswith("[")
            return f"[{host}]:{at}" if bracketed else f"{host}:{at}"

        channel_options = [
            ("grpc.max_receive_message_length", 16 << 20),
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_permit_without_calls", 0),
            # gRPC's own retries stay on for one kind only: transparent retries of a stream the
            # server refused before seeing it (REFUSED_STREAM at its per-connection stream
            # cap, a GOAWAY). No retry policy is configured, so every other retry is ours
            # (UNAVAILABLE only, ``RetryPolicy``).
            ("grpc.enable_retries", 1),
            *options,
        ]

        def channel(at: int) -> Any:
            if tls:
                credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
                return grpc.secure_channel(target(at), credentials, options=channel_options)
            return grpc.insecure_channel(target(at), options=channel_options)

        self._channel = channel(port)
        self._admin_channel = (channel(admin_port) if admin_port not in (None, port)
                               else self._channel)
        self._target = target(port)
        self._admin_target = target(admin_port) if admin_port is not None else self._target
        self._gateway = pb_grpc.GatewayStub(self._channel)
        self._admin = pb_grpc.AdminStub(self._admin_channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s
        self._retry = retry if retry is not None else RetryPolicy()

    def close(self) -> None:
        self._channel.close()
        if self._admin_channel is not self._channel:
            self._admin_channel.close()

    def __enter__(self) -> KvgateClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ---- Gateway ---------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        token_ids: Sequence[int] | None = None,
        tools: Sequence[Mapping[str, object] | str] | None = None,
        add_generation_prompt: bool | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ttl_s: float | None = None,
        shared: bool = False,
        no_cache: bool = False,
        tag: str | None = None,
        timeout_s: float | None = None,
        priority: int | None = None,
        session_id: str | None = None,
        allow_lossy: bool = False,
    ) -> Generator[TokenDelta | Usage, None, None]:
        """Stream a generation: ``TokenDelta`` items, then one ``Usage``.

        Send exactly one of ``prompt``, ``messages`` and ``token_ids``. Sampling fields left
        None take the server's defaults (greedy, 256 tokens). ``priority``: lower is served
        first among this key's tenant's own requests, -1000 to 1000 (None: the server's
        default, 0). ``allow_lossy``: the prompt may be served from lossy (quantized) copies
        where the gateway keeps them; the answer may then differ from the model's own, and its
        ``Usage.lossy`` says so (docs/design.md, "Lossy tiers"). Closing the generator early
        (``close()``, or dropping it) cancels the call: the server stops generating and
        releases its blocks. Nothing is sent before the first item is asked for.

        Raises:
            KvgateError: the call failed (on iteration).
        """
        request = pb.GenerateRequest(
            input=prompt_message(prompt, messages, token_ids, tools, add_generation_prompt),
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                       top_p=top_p, top_k=top_k, seed=seed, stop=list(stop)),
            cache=pb.CacheOptions(ttl_s=ttl_s, scope=_scope(shared), no_cache=no_cache,
                                  tag=tag, session_id=session_id, allow_lossy=allow_lossy),
            priority=priority,
        )
        return self._stream(request, timeout_s)

    def generate_text(self, prompt: str | None = None, **kwargs: Any) -> tuple[str, Usage]:
        """The whole generation at once: its text and its usage (same arguments as
        ``generate``)."""
        parts = []
        usage: Usage | None = None
        for item in self.generate(prompt, **kwargs):
            if isinstance(item, TokenDelta):
                parts.append(item.text)
            else:
                usage = item
        if usage is None:
            raise InternalError(grpc.StatusCode.INTERNAL, "the stream ended without usage")
        return "".join(parts), usage

    def warm(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        token_ids: Sequence[int] | None = None,
        tools: Sequence[Mapping[str, object] | str] | None = None,
        add_generation_prompt: bool | None = None,
        pin: bool = False,
        ttl_s: float | None = None,
        shared: bool = False,
        tag: str | None = None,
        timeout_s: float | None = None,
    ) -> WarmResult:
        """Compute and store the KV of the prompt's full blocks (``pin``: admin keys only);
        ``tag`` marks them for ``evict(tag=...)``."""
        request = pb.WarmRequest(
            input=prompt_message(prompt, messages, token_ids, tools, add_generation_prompt),
            pin=pin, ttl_s=ttl_s, scope=_scope(shared), tag=tag,
        )
        response = self._unary(self._gateway.Warm, request, timeout_s)
        return WarmResult(
            prompt_tokens=response.prompt_tokens, num_blocks=response.num_blocks,
            num_new_blocks=response.num_new_blocks,
            num_cached_blocks=response.num_cached_blocks,
            stored_bytes=response.stored_bytes, elapsed_ms=response.elapsed_ms,
        )

    def lookup(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str]] | None = None,
        token_ids: Sequence[int] | None = None,
        tools: Sequence[Mapping[str, object] | str] | None = None,
        add_generation_prompt: bool | None = None,
        shared: bool = False,
        allow_lossy: bool = False,
        previous_request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LookupResult:
        """How much of the prompt is cached in the caller's scope (nothing is computed); with
        ``allow_lossy``, counting the lossy copies a Generate allowing them would read; with
        ``previous_request_id`` (a Generate's ``usage.request_id``, a ``/v1/messages`` or
        ``/v1/responses`` id), the prompt compared with that earlier request
        (``LookupResult.comparison``; only with ``messages``)."""
        request = pb.LookupRequest(
            input=prompt_message(prompt, messages, token_ids, tools, add_generation_prompt),
            scope=_scope(shared), allow_lossy=allow_lossy,
            previous_request_id=previous_request_id,
        )
        r = self._unary(self._gateway.Lookup, request, timeout_s)
        return LookupResult(
            prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
            cached_tokens_by_tier=dict(r.cached_tokens_by_tier),
            num_prompt_blocks=r.num_prompt_blocks,
            diverges_at_block=r.diverges_at_block if r.HasField("diverges_at_block") else None,
            diverges_at_token=r.diverges_at_token if r.HasField("diverges_at_token") else None,
            text_around_divergence=r.text_around_divergence, lossy=r.lossy,
            comparison=prompt_comparison(r.comparison) if r.HasField("comparison") else None,
        )

    # ---- Admin -----------------------------------------------------------------------------

    def stats(self, *, timeout_s: float | None = None) -> StatsReport:
        r = self._admin_call(self._admin.Stats, pb.StatsRequest(), timeout_s)
        return StatsReport(
            num_blocks=r.num_blocks, num_namespaces=r.num_namespaces,
            num_token_mismatches=r.num_token_mismatches, num_remote_hits=r.num_remote_hits,
            tiers=tuple(
                TierReport(
                    name=t.name, num_blocks=t.num_blocks, used_bytes=t.used_bytes,
                    budget_bytes=t.budget_bytes, hits=t.hits, inserts=t.inserts,
                    refused=t.refused, promotions=t.promotions, demotions=t.demotions,
                    load_failures=t.load_failures, recomputed_instead=t.recomputed_instead,
                    evictions=dict(t.evictions),
                )
                for t in r.tiers
            ),
            stores=tuple(
                StoreReport(
                    name=s.name, num_blocks=s.num_blocks, num_bytes=s.num_bytes, hits=s.hits,
                    misses=s.misses, puts=s.puts, deletes=s.deletes, errors=s.errors,
                    verification_failures=dict(s.verification_failures),
                    is_available=s.is_available, notes=dict(s.notes),
                )
                for s in r.stores
            ),
            engine=EngineReport(
                route=r.engine.route, route_reason=r.engine.route_reason, steps=r.engine.steps,
                prefill_tokens=r.engine.prefill_tokens, decode_tokens=r.engine.decode_tokens,
                max_requests_in_step=r.engine.max_requests_in_step,
                dedup_waits=r.engine.dedup_waits, tail_hits=r.engine.tail_hits,
                tail_tokens=r.engine.tail_tokens, tail_bytes=r.engine.tail_bytes,
                dtype=r.engine.dtype,
                device=r.engine.device,
            ) if r.HasField("engine") else None,
        )

    def list_prefixes(self, *, tenant: str | None = None, limit: int = 0,
                      timeout_s: float | None = None) -> list[PrefixInfo]:
        request = pb.ListPrefixesRequest(tenant=tenant, limit=limit)
        r = self._admin_call(self._admin.ListPrefixes, request, timeout_s)
        return [
            PrefixInfo(
                tenant=p.tenant, key_hex=p.key_hex, num_blocks=p.num_blocks,
                num_tokens=p.num_tokens, num_bytes=p.num_bytes, tiers=tuple(p.tiers),
                age_s=p.age_s, idle_s=p.idle_s, num_hits=p.num_hits, is_pinned=p.is_pinned,
                preview=p.preview, tags=tuple(p.tags),
            )
            for p in r.prefixes
        ]

    def evict(self, *, tenant: str | None = None, prefix_text: str | None = None,
              key_hex: str | None = None, older_than_s: float | None = None,
              tier: str | None = None, everything: bool = False, tag: str | None = None,
              timeout_s: float | None = None) -> Evicted:
        request = pb.EvictRequest(tenant=tenant, prefix_text=prefix_text, key_hex=key_hex,
                                  older_than_s=older_than_s, tier=tier, everything=everything,
                                  tag=tag)
        return _evicted(self._admin_call(self._admin.Evict, request, timeout_s))

    def pin(self, prompt: str | None = None, *, unpin: bool = False,
            messages: Sequence[Mapping[str, str]] | None = None,
            token_ids: Sequence[int] | None = None,
            add_generation_prompt: bool | None = None,
            shared: bool = False, tenant: str = "",
            timeout_s: float | None = None) -> int:
        """(Un)pin a prefix in a tenant's scope (default: the admin's own) or the shared one;
        returns the number of blocks whose flag changed."""
        request = pb.PinRequest(
            input=prompt_message(prompt, messages, token_ids, None, add_generation_prompt),
            scope=_scope(shared), tenant=tenant,
        )
        method = self._admin.Unpin if unpin else self._admin.Pin
        return int(self._admin_call(method, request, timeout_s).num_blocks)

    def set_quota(self, tenant: str, num_bytes: int | None, *,
                  timeout_s: float | None = None) -> None:
        request = pb.SetQuotaRequest(tenant=tenant, num_bytes=num_bytes)
        self._admin_call(self._admin.SetQuota, request, timeout_s)

    def flush(self, *, timeout_s: float | None = None) -> Evicted:
        return _evicted(self._admin_call(self._admin.Flush, pb.FlushRequest(), timeout_s))

    def list_sessions(self, *, tenant: str | None = None, limit: int = 0,
                      timeout_s: float | None = None) -> list[SessionInfo]:
        """The sessions (``generate(session_id=...)``) the replica knows, latest first."""
        request = pb.ListSessionsRequest(tenant=tenant, limit=limit)
        r = self._admin_call(self._admin.ListSessions, request, timeout_s)
        return [SessionInfo(tenant=s.tenant, session_id=s.session_id, num_blocks=s.num_blocks,
                            num_bytes=s.num_bytes, tail_tokens=s.tail_tokens, idle_s=s.idle_s,
                            expires_in_s=s.expires_in_s) for s in r.sessions]

    def reset_session(self, session_id: str, *, tenant: str | None = None,
                      timeout_s: float | None = None) -> SessionReset:
        """Drop what a session owns from every tier and replica (``NotFound``: the replica
        knows no such session of ``tenant``)."""
        request = pb.ResetSessionRequest(session_id=session_id, tenant=tenant)
        r = self._admin_call(self._admin.ResetSession, request, timeout_s)
        return SessionReset(tenant=r.tenant, num_blocks=r.num_blocks,
                            bytes_by_tier=dict(r.bytes_by_tier), tail_bytes=r.tail_bytes)

    # ---- calls -----------------------------------------------------------------------------

    def _admin_call(self, method: Callable[..., T], request: object,
                    timeout_s: float | None) -> T:
        return self._unary(method, request, timeout_s, target=self._admin_target)

    def _unary(self, method: Callable[..., T], request: object, timeout_s: float | None, *,
               target: str | None = None) -> T:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self._timeout_s)
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=max(0.0, deadline - time.monotonic()),
                              metadata=self._metadata)
            except grpc.RpcError as exc:
                if not self._should_retry(exc, attempt, deadline):
                    raise error_of(exc, target or self._target) from None

    def _stream(self, request: pb.GenerateRequest,
                timeout_s: float | None) -> Generator[TokenDelta | Usage, None, None]:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self._timeout_s)
        attempt = 0
        while True:
            attempt += 1
            call = self._gateway.Generate(
                request, timeout=max(0.0, deadline - time.monotonic()), metadata=self._metadata
            )
            received = False
            try:
                for response in call:
                    received = True
                    yield stream_item(response)
                return
            except grpc.RpcError as exc:
                if received or not self._should_retry(exc, attempt, deadline):
                    raise error_of(exc, self._target) from None
            finally:
                call.cancel()  # a no-op after the end; stops the server if we stop early

    def _should_retry(self, exc: grpc.RpcError, attempt: int, deadline: float) -> bool:
        if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt >= self._retry.max_attempts:
            return False
        if _NOT_HTTP2.search(exc.details() or ""):
            return False  # an HTTP/1.x server: asking again gets the same answer
        pause = self._retry.backoff_s(attempt)
        if time.monotonic() + pause >= deadline:
            return False
        time.sleep(pause)
        return True


# ---- records <-> protobuf ------------------------------------------------------------------


def prompt_message(
    prompt: str | None,
    messages: Sequence[Mapping[str, str]] | None,
    token_ids: Sequence[int] | None,
    tools: Sequence[Mapping[str, object] | str] | None,
    add_generation_prompt: bool | None,
) -> pb.PromptInput:
    """The ``PromptInput`` message; tools given as objects are written as JSON."""
    return pb.PromptInput(
        messages=[pb.Message(role=m["role"], content=m["content"]) for m in messages or ()],
        prompt=prompt,
        token_ids=list(token_ids or ()),
        tools=[t if isinstance(t, str) else json.dumps(t) for t in tools or ()],
        add_generation_prompt=add_generation_prompt,
    )


def _scope(shared: bool) -> pb.Scope:
    return pb.SCOPE_SHARED if shared else pb.SCOPE_TENANT


def stream_item(response: pb.GenerateResponse) -> TokenDelta | Usage:
    if response.HasField("delta"):
        return TokenDelta(token_ids=tuple(response.delta.token_ids), text=response.delta.text)
    u = response.usage
    return Usage(
        prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
        cached_tokens_by_tier=dict(u.cached_tokens_by_tier),
        completion_tokens=u.completion_tokens, ttft_ms=u.ttft_ms, total_ms=u.total_ms,
        finish_reason=_FINISH_REASONS.get(u.finish_reason, "stop"), lossy=u.lossy,
        request_id=u.request_id,
    )


def prompt_comparison(m: pb.PromptComparison) -> PromptComparison:
    """The record of a ``LookupResponse.comparison`` (a part named as ``PromptPart`` says it)."""
    part = (pb.PromptPart.Name(m.changed_part).removeprefix("PROMPT_PART_").lower()
            if m.changed_part in pb.PromptPart.values() else "unspecified")
    return PromptComparison(
        previous_known=m.previous_known, changed_part=None if part == "unspecified" else part,
        first_changed_message=(m.first_changed_message if m.HasField("first_changed_message")
                               else None), common_tokens=m.common_tokens,
        first_differing_block=(m.first_differing_block if m.HasField("first_differing_block")
                               else None),
        previous_cached_tokens=m.previous_cached_tokens, missed_tokens=m.missed_tokens)


def _evicted(response: pb.EvictResponse) -> Evicted:
    return Evicted(num_blocks=response.num_blocks, bytes_by_tier=dict(response.bytes_by_tier))
