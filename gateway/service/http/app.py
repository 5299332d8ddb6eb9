"""The ASGI application of the HTTP front: routes, and the path of one OpenAI or Anthropic
request.

One request, in this order (the gRPC servicer's order, so the surfaces refuse alike):

1. authenticate ``Authorization: Bearer <key>`` with the gRPC service's ``Authenticator``
   (401) -- before the body is read, so a caller without a key cannot make the gateway buffer
   anything;
2. the engine (503 while the model loads or the server drains);
3. read the body, at most ``max_body_bytes`` (413: the Content-Length is checked before reading,
   a chunked body as it arrives) within ``body_timeout_s`` (408, and the connection closed),
   parse JSON (400) and validate every field (``openai_requests``; 400 naming the field, 404
   for a model not served). A body over ``INLINE_PARSE_BYTES`` is parsed and validated on a
   worker thread, so that megabytes of JSON do not stall the event loop for other requests;
4. take the key's call slot (``Admission``, 429 naming the limit) -- only now, so that a body
   that trickles in holds no slot;
5. submit to the engine on a worker thread (canonicalisation is tokenisation: not on the event
   loop); its refusals are the gRPC ones (429 with Retry-After for a full queue, 400...);
6. wait for the first event while watching the connection: a client that goes away cancels the
   request and frees its blocks (``edge.Generation``). An error before the first token is still
   an HTTP status; after it, an error is an ``error`` event in the stream.

Anthropic's ``POST /v1/messages`` takes the same path: its key may come as ``x-api-key``
(``anthropic_requests.credentials``), its body is parsed by ``anthropic_requests``, its answer
and errors are shaped by ``anthropic_responses``, and a request whose 1-hour breakpoint comes
before a 5-minute one warms the 1-hour prefix first, in its call slot
(``cache_breakpoints.warm_longer_prefix``). OpenAI's ``POST /v1/responses`` too: a request
naming ``previous_response_id`` gets the conversation its tenant kept before its own turn, and
an answer it asked to ``store`` is kept once it is whole (``responses_route``). A Messages or
Responses request that sends tools or tool calls is checked first against what the model's chat
template renders (``template_tools``), before anything is warmed or run.

The engine's handle blocks, so each wait for an event runs on a worker thread
(``anyio.to_thread``, bounded by a limiter of ``max_connections``), abandoned -- and the request
cancelled -- when the client disconnects.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
import anyio.to_thread
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.config.keys import Principal
from gateway.core.errors import EngineDraining
from gateway.core.requests import TokenDelta, Usage
from gateway.service.access_log import AccessCall, AccessLog
from gateway.service.admission import Admission, CallKind, CallSlot
from gateway.service.auth import Authenticator
from gateway.service.edge import EdgeLimits, Generation
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.anthropic_requests import MessagesCall, credentials, parse_messages
from gateway.service.http.anthropic_responses import MessagesRendering, anthropic_error_answer
from gateway.service.http.base import AnswerRendering, ErrorShape
from gateway.service.http.cache_breakpoints import warm_longer_prefix
from gateway.service.http.errors import ErrorAnswer, HttpFailure, error_answer
from gateway.service.http.hosted_diagnostics import HostedDiagnostics
from gateway.service.http.metrics_page import MetricsPage
from gateway.service.http.openai_requests import (
    OpenAICall,
    check_model,
    parse_call,
    with_session,
)
from gateway.service.http.openai_responses import Rendering
from gateway.service.http.pending_bodies import PendingBodies
from gateway.service.http.responses_rendering import ResponsesRendering
from gateway.service.http.responses_requests import ResponsesCall, parse_responses
from gateway.service.http.responses_route import StoredResponsesRoute
from gateway.service.http.stored_responses import MemoryResponses, ResponseStore
from gateway.service.http.template_tools import TemplateProbe, uses_tools
from gateway.service.prompt_comparisons import PromptComparisons
from gateway.service.scrape_token import CHALLENGE, ScrapeToken
from gateway.service.scrape_token import REFUSAL as SCRAPE_REFUSAL

if TYPE_CHECKING:
    from gateway.engine.engine import Engine

logger = logging.getLogger(__name__)

T = TypeVar("T")
Event = TokenDelta | Usage
Api = Literal["chat", "completion", "messages", "responses"]
"""The generating routes: OpenAI's chat and text completions and responses, Anthropic's
messages."""
Call = OpenAICall | MessagesCall | ResponsesCall

ERROR_SHAPES: dict[Api, ErrorShape] = {
    "chat": error_answer,
    "completion": error_answer,
    "messages": anthropic_error_answer,
    "responses": error_answer,
}
"""The shape of each route's errors (the status is the same whichever)."""

INLINE_PARSE_BYTES = 64 << 10
"""Bodies up to this size are parsed on the event loop (well under a millisecond); bigger ones
on a worker thread."""


class ClientGone(Exception):
    """The client closed the connection while its request was waiting or running."""


def served_model_names(model_name: str, served: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The ``model`` values this gateway answers to, the one it reports first.

    Args:
        model_name: the engine's model (``--model``: ``bundled`` or a checkpoint directory).
        served: ``[http] served_model_name`` (``--served-model-name``): when given, exactly
            these, as vLLM does. Otherwise the short id (a checkpoint directory's name, or
            ``bundled``), then the ``--model`` value itself.
    """
    if served:
        return served
    short = Path(model_name).name or model_name
    return (short,) if short == model_name else (short, model_name)


class OpenAIFront:
    """The routes of the OpenAI-compatible API over one engine slot.

    Args:
        engines: the slot the gRPC server shares (empty while the model loads).
        authenticator: the gRPC service's keys.
        limits: the gRPC service's deadline and TTL bounds.
        max_body_bytes: largest request body.
        max_threads: worker threads waiting on engine events at once.
        retry_after_s: ``Retry-After`` of a 429 or 503.
        body_timeout_s: the longest a body may take to arrive once the front reads it (408).
        admission: the per-key call limits shared with the gRPC service (None: none here).
        max_pending_bodies_per_tenant: bodies one tenant may be sending at once
            (``gateway.service.http.pending_bodies``).
        access: where each chat and completion leaves its line (None: nowhere).
        metrics: the registry ``GET /metrics`` renders: it must hold no per-tenant series
            (None: no such route).
        scrape_token: what a scrape of ``/metrics`` must send (None: nothing, it is open).
        served_model_name: the model ids to answer to (``served_model_names``; empty: the
            engine's model).
        session_from_user: a body's ``user`` names its session too (``with_session``).
        responses: where ``POST /v1/responses`` keeps what it is asked to ``store`` (None: a
            store of 1,000 responses and 64 Mi characters per tenant, kept an hour after their
            last use).
        comparisons: the shapes of recent requests, shared with the gRPC server so that
            ``Lookup`` can name this front's ids.
    """

    def __init__(self, engines: EngineSlot, authenticator: Authenticator, limits: EdgeLimits,
                 *, max_body_bytes: int, max_threads: int, retry_after_s: int,
                 body_timeout_s: float, admission: Admission | None = None,
                 max_pending_bodies_per_tenant: int = 16,
                 access: AccessLog | None = None,
                 metrics: CollectorRegistry | None = None,
                 scrape_token: ScrapeToken | None = None,
                 served_model_name: tuple[str, ...] = (),
                 session_from_user: bool = False,
                 responses: ResponseStore | None = None,
                 comparisons: PromptComparisons) -> None:
        self._engines = engines
        self._stored = StoredResponsesRoute(
            responses if responses is not None else MemoryResponses(
                max_per_tenant=1000, max_chars_per_tenant=64 << 20, default_ttl_s=3600.0),
            authenticator, limits.prompt, self._error)
        self._diagnostics = HostedDiagnostics(comparisons)
        self._template_tools = TemplateProbe()
        self._session_from_user = session_from_user
        self._served = served_model_name
        self._access = access
        self._metrics = MetricsPage(metrics) if metrics is not None else None
        self._scrape_token = scrape_token
        self._auth = authenticator
        self._admission = admission
        self._limits = limits
        self._max_body_bytes = max_body_bytes
        self._max_threads = max_threads
        self._retry_after_s = retry_after_s
        self._body_timeout_s = body_timeout_s
        self._pending = PendingBodies(max_pending_bodies_per_tenant)
        self._limiter: anyio.CapacityLimiter | None = None
        self._is_draining = False
        self._started = int(time.time())

    def app(self) -> Starlette:
        """The ASGI application."""
        return Starlette(
            routes=[
                Route("/v1/chat/completions", partial(self._generate, "chat"),
                      methods=["POST"]),
                Route("/v1/completions", partial(self._generate, "completion"),
                      methods=["POST"]),
                Route("/v1/messages", partial(self._generate, "messages"),
                      methods=["POST"]),
                Route("/v1/responses", partial(self._generate, "responses"),
                      methods=["POST"]),
                Route("/v1/responses/{id}", self._stored.handle, methods=["GET", "DELETE"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/models/{model:path}", self._model, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                *([Route("/metrics", self._render_metrics, methods=["GET"])]
                  if self._metrics is not None else []),
            ],
            exception_handlers={HTTPException: self._http_exception},  # type: ignore[dict-item]
        )

    def begin_shutdown(self) -> None:
        """Refuse new requests (503); those in flight go on."""
        self._is_draining = True

    # ---- routes ------------------------------------------------------------------------

    async def _health(self, request: Request) -> Response:
        try:
            engine = self._engine()
        except EngineDraining as exc:
            status = "draining" if self._is_draining else "loading"
            return JSONResponse({"status": status, "detail": str(exc)}, status_code=503,
                                headers={"Retry-After": str(self._retry_after_s)})
        if not engine.is_ready:
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": str(self._retry_after_s)})
        return JSONResponse({"status": "ok", "model": self._names(engine)[0]})

    async def _render_metrics(self, request: Request) -> Response:
        """Prometheus' text format (or OpenMetrics, if the scraper asks for it).

        NOTE: rendered on the event loop: about a millisecond with the registry populated, a
        few where the caches went cold between two polls (docs/operations.md, "Cost of a
        scrape"), little more than a thread hop would add; and at most once per 20 ms for all
        scrapers together (``MetricsPage``).
        """
        assert self._metrics is not None
        if (self._scrape_token is not None
                and not self._scrape_token.allows(request.headers.get("authorization"))):
            return Response(SCRAPE_REFUSAL + "\n", status_code=401, media_type="text/plain",
                            headers={"WWW-Authenticate": CHALLENGE})
        body, content_type = self._metrics.render(request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    async def _models(self, request: Request) -> Response:
        try:
            self._auth.authenticate(request.headers.items(), is_http=True)
            names = self._names(self._engine())
        except Exception as exc:
            return self._error(exc, request)
        return JSONResponse({"object": "list", "data": [self._model_object(names[0])]})

    async def _model(self, request: Request) -> Response:
        try:
            self._auth.authenticate(request.headers.items(), is_http=True)
            names = self._names(self._engine())
            if request.path_params["model"] not in names:
                raise HttpFailure(status=404, type="invalid_request_error",
                                  code="model_not_found", param="model",
                                  message=f"the model {request.path_params['model']!r} is not "
                                          f"served here; this gateway serves {names[0]!r}")
        except Exception as exc:
            return self._error(exc, request)
        return JSONResponse(self._model_object(names[0]))

    async def _generate(self, kind: Api, request: Request) -> Response:
        slot: CallSlot | None = None
        streaming = False
        access = AccessCall(self._access, f"http.{kind}")
        response: Response | None = None
        try:
            headers = request.headers.items()
            principal = self._auth.authenticate(
                credentials(headers) if kind == "messages" else headers, is_http=True)
            access.tenant = principal.tenant
            engine = self._engine()
            with self._pending.hold(principal.tenant):
                call = await self._call(kind, request, principal)
            call = with_session(call, request.headers.get("x-session-id"),
                                from_user=self._session_from_user,
                                user_field="metadata.user_id" if kind == "messages" else "user")
            check_model(call.model, self._names(engine))
            if isinstance(call, ResponsesCall) and call.previous_response_id is not None:
                call = self._stored.continued(call, principal)
            if self._admission is not None:  # the same per-key limits as over gRPC
                slot = self._admission.admit(principal, CallKind.GENERATE)
            response = await self._generate_admitted(engine, kind, call, request, slot, access)
            streaming = isinstance(response, StreamingResponse)
            return response
        except ClientGone:
            logger.debug("%s: the client went away while sending its body", request.url.path)
            response = Response(status_code=499)
            return response
        except Exception as exc:
            response = self._error(exc, request, kind)
            return response
        finally:
            if slot is not None and not streaming:  # a stream releases it when it ends
                slot.release()
            if not streaming:  # a stream writes its line when it ends
                access.end(str(response.status_code) if response is not None else "499")

    async def _generate_admitted(self, engine: Engine, kind: Api, call: Call, request: Request,
                                 slot: CallSlot | None, access: AccessCall) -> Response:
        try:
            if not isinstance(call, OpenAICall) and any(uses_tools(call.request.prompt)):
                await self._in_thread(partial(  # before anything is warmed or run
                    self._template_tools.check, engine, call.request.prompt,
                    model=self._names(engine)[0], tools_param="tools",
                    calls_param="messages" if isinstance(call, MessagesCall) else "input"))
            rendering = await self._rendering(engine, call, request)
            handle = await self._in_thread(engine.generate, call.request)
        except ClientGone:
            logger.debug("%s: the client went away; request cancelled", request.url.path)
            return Response(status_code=499)
        except Exception as exc:
            return self._error(exc, request, kind)
        generation = Generation(handle)
        try:
            first = await self._until_gone(request, generation.next_item)
            if not call.stream:
                rest: list[Event] = await self._until_gone(request, partial(list, generation))
                for item in rest:
                    if isinstance(item, Usage):
                        access.saw_usage(item)
                return self._answer(rendering, [first, *rest])
        except ClientGone:
            generation.cancel_unless_delivered()
            logger.debug("%s: the client went away; request cancelled", request.url.path)
            return Response(status_code=499)
        except Exception as exc:
            generation.cancel_unless_delivered()
            return self._error(exc, request, kind)
        events = self._events(kind, rendering, generation, first, slot, access)
        if slot is not None:  # also when the stream never starts (the client left first)
            weakref.finalize(events, slot.release)
        return StreamingResponse(events,
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ---- the stream -------------------------------------------------------------------

    async def _rendering(self, engine: Engine, call: Call, request: Request) -> AnswerRendering:
        """How the answer is written; for a Messages call whose 1-hour breakpoint comes before
        a 5-minute one, after its 1-hour prefix is warmed (``warm_longer_prefix``).

        Raises:
            ClientGone: the client went away during the warm.
            GatewayError: the warm was refused or failed.
        """
        # NOTE: the first served name, whichever alias the request used (as vLLM answers).
        model = self._names(engine)[0]
        if isinstance(call, OpenAICall):
            return Rendering(kind=call.kind, model=model, include_usage=call.include_usage)
        if isinstance(call, ResponsesCall):
            keep = partial(self._stored.keep, call) if call.store else None
            compared, keep_shape = await self._in_thread(self._diagnostics.responses, call,
                                                         engine)
            return ResponsesRendering(model=model, call=call, on_done=keep,
                                      on_usage=keep_shape, cache_diagnostics=compared)
        diagnostics, keep_message_shape = (
            await self._in_thread(self._diagnostics.messages, call, engine)
            if call.diagnose else (None, None))
        warmed = 0
        if call.caching.longer is not None and not call.request.cache.no_cache:
            warmed = await self._until_gone(request, partial(
                warm_longer_prefix, engine, call.request.prompt, call.caching,
                scope=call.request.scope, deadline=call.request.deadline))
        return MessagesRendering(model=model, caching=call.caching,
                                 stop_sequences=call.stop_sequences, warmed_tokens=warmed,
                                 diagnostics=diagnostics, on_usage=keep_message_shape)

    async def _events(self, kind: Api, rendering: AnswerRendering, generation: Generation,
                      first: Event | None, slot: CallSlot | None = None,
                      access: AccessCall | None = None) -> AsyncIterator[str]:
        """The SSE events of a stream whose first event has arrived.

        NOTE: Starlette cancels this generator when the client disconnects; ``finally`` then
        cancels the generation, and the engine frees its blocks at its next step.
        """
        status = "499"  # unless set below: the client went away mid-stream
        try:
            for event in rendering.opening():
                yield event
            item = first
            while item is not None:
                if isinstance(item, Usage):
                    if access is not None:
                        access.saw_usage(item)
                    for event in rendering.closing(item):
                        yield event
                elif item.text:
                    yield rendering.delta(item.text)
                item = await self._in_thread(generation.next_item)
            status = "200"
        except Exception as exc:  # after the headers: an error event ends the stream
            answer = ERROR_SHAPES[kind](exc, where=f"{kind} stream",
                                        retry_after_s=self._retry_after_s)
            status = f"200+{answer.status}"  # the error event's status, inside a 200 stream
            yield rendering.stream_error(answer)
        finally:
            generation.cancel_unless_delivered()
            if slot is not None:
                slot.release()
            if access is not None:
                access.end(status)

    # ---- helpers ----------------------------------------------------------------------

    def _names(self, engine: Engine) -> tuple[str, ...]:
        return served_model_names(engine.model_name, self._served)

    def _engine(self) -> Engine:
        if self._is_draining:
            raise EngineDraining("the server is shutting down; retry on another replica")
        return self._engines.get()

    async def _call(self, kind: Api, request: Request, principal: Principal) -> Call:
        """The request's body read, parsed and validated: off the event loop if it is big."""
        raw = await self._body(request)
        if len(raw) <= INLINE_PARSE_BYTES:
            return _parsed_call(kind, raw, principal, self._limits)
        return await self._in_thread(
            partial(_parsed_call, kind, raw, principal, self._limits, is_off_loop=True))

    async def _body(self, request: Request) -> bytes:
        """The whole body, at most ``max_body_bytes``, within ``body_timeout_s``.

        Raises:
            HttpFailure: over the limit (413), a bad Content-Length (400), too slow (408).
            ClientGone: the client closed the connection first.
        """
        limit = self._max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise _too_large(limit) if length.isdigit() else HttpFailure(
                status=400, type="invalid_request_error", code="invalid_argument",
                message="the Content-Length header is not a number")
        chunks: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(self._body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(limit)
                    chunks.append(chunk)
        except TimeoutError:
            raise HttpFailure(status=408, type="invalid_request_error", code="request_timeout",
                              message=f"the request body did not arrive within "
                                      f"{self._body_timeout_s:g} s ([http] body_timeout_s); "
                                      "send it whole, right after the headers") from None
        except ClientDisconnect:
            raise ClientGone() from None
        return b"".join(chunks)

    async def _in_thread(self, func: Callable[..., T], *args: Any) -> T:
        if self._limiter is None:  # NOTE: made here, inside the event loop that uses it
            self._limiter = anyio.CapacityLimiter(self._max_threads)
        return await anyio.to_thread.run_sync(func, *args, abandon_on_cancel=True,
                                              limiter=self._limiter)

    async def _until_gone(self, request: Request, func: Callable[[], T]) -> T:
        """``func()`` on a worker thread, unless the client disconnects first (``ClientGone``).

        The body has been read, so the next ASGI message is the disconnect.
        """
        outcome: list[T] = []
        failures: list[Exception] = []
        async with anyio.create_task_group() as group:
            async def watch() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                outcome.append(await self._in_thread(func))
            except Exception as exc:  # raised below, outside the task group
                failures.append(exc)
            group.cancel_scope.cancel()
        if failures:
            raise failures[0]
        if not outcome:
            raise ClientGone()
        return outcome[0]

    def _answer(self, rendering: AnswerRendering, items: list[Event | None]) -> Response:
        text = "".join(item.text for item in items if isinstance(item, TokenDelta))
        usage = next(item for item in items if isinstance(item, Usage))
        return JSONResponse(rendering.completion(text, usage))

    def _model_object(self, name: str) -> dict[str, object]:
        return {"id": name, "object": "model", "created": self._started, "owned_by": "kvgate"}

    def _error(self, exc: BaseException, request: Request, kind: Api = "chat") -> Response:
        answer: ErrorAnswer = ERROR_SHAPES[kind](exc, where=request.url.path,
                                                 retry_after_s=self._retry_after_s)
        return JSONResponse(answer.body, status_code=answer.status, headers=answer.headers)

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own 404 and 405, in OpenAI's error shape (Anthropic's under
        ``/v1/messages``)."""
        failure = HttpFailure(status=exc.status_code, type="invalid_request_error",
                              code="not_found" if exc.status_code == 404 else "bad_method",
                              message=f"{request.method} {request.url.path}: {exc.detail}; "
                                      "kvgate serves POST /v1/chat/completions, POST "
                                      "/v1/completions, POST /v1/messages, POST /v1/responses, "
                                      "GET /v1/models and GET /health")
        kind: Api = "messages" if request.url.path.startswith("/v1/messages") else "chat"
        return self._error(failure, request, kind)


def _too_large(limit: int) -> HttpFailure:
    return HttpFailure(status=413, type="invalid_request_error", code="request_too_large",
                       message=f"the request body is over this gateway's limit of {limit} "
                               "bytes ([http] max_body_bytes); send a shorter prompt")


def _parsed_call(kind: Api, raw: bytes, principal: Principal, limits: EdgeLimits, *,
                 is_off_loop: bool = False) -> Call:
    """The call a body asks for.

    NOTE: off the event loop, numbers are parsed by Python functions rather than by the
    decoder's C code: a JSON array of a million numbers then takes about twice as long, but the
    worker thread gives up the GIL every switch interval instead of holding it throughout, so
    the event loop (other requests, ``/health``) goes on meanwhile.

    Raises:
        HttpFailure: not one JSON object (400).
        InvalidParam: what ``parse_call`` (``parse_messages``) refuses.
    """
    try:
        body = json.loads(raw, parse_constant=_reject_constant,
                          parse_int=_int if is_off_loop else None,
                          parse_float=_float if is_off_loop else None)
    except (ValueError, RecursionError) as exc:
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise HttpFailure(status=400, type="invalid_request_error", code="invalid_argument",
                          message=f"the request body is not valid JSON ({detail}); send "
                                  "one JSON object") from None
    if not isinstance(body, dict):
        raise HttpFailure(status=400, type="invalid_request_error", code="invalid_argument",
                          message="the request body must be one JSON object")
    if kind == "messages":
        return parse_messages(body, principal, limits=limits)
    if kind == "responses":
        return parse_responses(body, principal, limits=limits)
    return parse_call(kind, body, principal, limits=limits)


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a JSON number")


def _int(text: str) -> int:
    return int(text)


def _float(text: str) -> float:
    return float(text)

