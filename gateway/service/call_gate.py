"""Authentication and admission before any worker thread: how a call gets into the gRPC server.

Measured against grpcio's synchronous server (1.85): a unary-request method's worker thread is
taken when the call's *headers* arrive and then waits, without limit, for the request message;
``maximum_concurrent_rpcs`` counts such calls before any key is checked. 64 calls that sent
headers and no body, with no key, locked every keyed call and every health check out of an
earlier kvgate. What this module does instead:

- **Keyed services** (``KeyedService``): the handler of a call is chosen on the server's polling
  thread, which has the call's metadata. There the key is checked and the call admitted
  (``gateway.service.admission``); a call with no valid key, or over a limit, gets a *refusal*
  handler that ends it with its status at once, without reading its body, on a small pool of
  its own (so refusals never wait behind work, nor work behind refusals). An admitted call runs
  on the worker pool, which has one thread per admission slot.
- **Body timeout**: every method is served as request-streaming, so its behaviour starts on the
  headers and reads the request message itself, under a ``BodyWatchdog`` that cancels the call
  if the message has not arrived within ``body_timeout_s``. A keyed call that never sends its
  body holds its thread and slot for that long, no longer.
- **Public services** (``PublicServicesGate``, a server interceptor): health checking and
  reflection need no key. Each runs on a pool of its own with a cap on calls in flight (over the
  cap: RESOURCE_EXHAUSTED at once) and the same body timeout, so a flood of them takes neither
  keyed calls' threads nor each other's.

Per-connection stream caps (``grpc.max_concurrent_streams``) and the handshake timeout are
server options (``GrpcSettings.server_options``).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.config.keys import Principal
from gateway.core.errors import GatewayError
from gateway.service.admission import Admission, CallKind, CallSlot, Overloaded
from gateway.service.auth import Authenticator
from gateway.service.status_mapping import status_of

logger = logging.getLogger(__name__)

KeyedBehavior = Callable[[object, Principal, Any], Any]
"""``implementation(request, principal, context)``: a response, or an iterator of them."""


class BodyWatchdog:
    """Cancels calls whose request message has not arrived within ``timeout_s``.

    One thread and a heap of deadlines, however many calls wait (a ``threading.Timer`` per call
    would cost a thread per call, which is what this is here to bound).

    Args:
        timeout_s: how long a call may take to send its request message after its headers.
        clock: monotonic seconds.
    """

    def __init__(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._waiting: dict[int, Any] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._is_stopping = False
        self.num_cancelled = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvgate-body-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._is_stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def first_message(self, requests: Iterator[Any], context: Any) -> Any:
        """The call's first request message, waited for at most ``timeout_s``.

        Raises (through ``context.abort``, which ends the call): INVALID_ARGUMENT when the
        client closed its side without a message; CANCELLED when the call was cancelled, by its
        client or by this watchdog.
        """
        token = next(self._ids)
        with self._cond:
            self._waiting[token] = context
            heapq.heappush(self._heap, (self._clock() + self.timeout_s, token))
            self._cond.notify_all()
        try:
            return next(requests)
        except StopIteration:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the call ended without a request message; send exactly one")
        except grpc.RpcError:
            context.abort(grpc.StatusCode.CANCELLED,
                          f"no request message within {self.timeout_s:g} s of the headers "
                          "(grpc.body_timeout_s), or the call was cancelled")
        finally:
            with self._cond:
                self._waiting.pop(token, None)
        raise AssertionError("unreachable: context.abort raises")

    def _run(self) -> None:
        while True:
            due: list[Any] = []
            with self._cond:
                while not self._is_stopping:
                    while self._heap and self._heap[0][1] not in self._waiting:
                        heapq.heappop(self._heap)  # its message came
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait = self._heap[0][0] - self._clock()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._is_stopping:
                    return
                now = self._clock()
                while self._heap and self._heap[0][0] <= now:
                    _, token = heapq.heappop(self._heap)
                    context = self._waiting.pop(token, None)
                    if context is not None:
                        due.append(context)
                self.num_cancelled += len(due)
            for context in due:
                logger.debug("cancelled a call that sent no request within %.1f s (peer %s)",
                             self.timeout_s, context.peer())
                context.cancel()


def refusal(exc: BaseException, pool: futures.ThreadPoolExecutor) -> grpc.RpcMethodHandler:
    """A handler that ends a call with ``exc``'s status at once, without reading its body."""
    status = status_of(exc)

    def refuse(requests: Iterator[Any], context: Any) -> None:
        context.abort(status.code, status.message)

    refuse.experimental_thread_pool = pool  # type: ignore[attr-defined]
    # NOTE: request-streaming whatever the method: a unary-request handler would first wait
    # for the body (the very wait this refusal exists to avoid).
    return grpc.stream_stream_rpc_method_handler(refuse)


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyedMethod:
    """One method of a keyed service.

    Attributes:
        behavior: ``implementation(request, principal, context)``; it maps its own errors to
            statuses.
        request_deserializer, response_serializer: the message (de)serialisers.
        response_streaming: the method streams its responses.
        kind: what it does, for admission.
    """

    behavior: KeyedBehavior
    request_deserializer: Callable[[bytes], object]
    response_serializer: Callable[[Any], bytes]
    response_streaming: bool
    kind: CallKind


class CallGate:
    """Authenticates and admits a call from its metadata, and builds the handler that serves it.

    Args:
        authenticator: the API keys.
        admission: per-key limits.
        watchdog: the body timeout.
        worker_pool: where admitted calls run (one thread per admission slot).
        refusal_pool: where refusals run (a few threads; each refusal takes microseconds).
    """

    def __init__(self, authenticator: Authenticator, admission: Admission,
                 watchdog: BodyWatchdog, *, worker_pool: futures.ThreadPoolExecutor,
                 refusal_pool: futures.ThreadPoolExecutor) -> None:
        self._auth = authenticator
        self._admission = admission
        self._watchdog = watchdog
        self._workers = worker_pool
        self._refusals = refusal_pool

    def handler(self, method: KeyedMethod, metadata: Sequence[tuple[str, Any]] | None,
                *, is_admin_only: bool) -> grpc.RpcMethodHandler:
        """The handler of one call: a refusal, or the admitted method (on the polling thread:
        this hashes one key and counts; it never blocks)."""
        try:
            principal = self._auth.authenticate(metadata)
            if is_admin_only:
                principal.require_admin("the Admin service")
            slot = self._admission.admit(principal, method.kind)
        except GatewayError as exc:
            return refusal(exc, self._refusals)
        return self._admitted(method, principal, slot)

    def _admitted(self, method: KeyedMethod, principal: Principal,
                  slot: CallSlot) -> grpc.RpcMethodHandler:
        watchdog = self._watchdog
        behavior = method.behavior

        def unary(requests: Iterator[Any], context: Any) -> Any:
            _release_at_end(context, slot)
            try:
                request = watchdog.first_message(requests, context)
                return behavior(request, principal, context)
            finally:
                slot.release()

        def streaming(requests: Iterator[Any], context: Any) -> Iterator[Any]:
            # NOTE: a plain function returning a generator: grpc may never start the generator
            # of a call cancelled early, so the slot is released by the call's end as well.
            _release_at_end(context, slot)

            def responses() -> Iterator[Any]:
                try:
                    request = watchdog.first_message(requests, context)
                    yield from behavior(request, principal, context)
                finally:
                    slot.release()

            return responses()

        if method.response_streaming:
            streaming.experimental_thread_pool = self._workers  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(
                streaming, request_deserializer=method.request_deserializer,
                response_serializer=method.response_serializer)
        unary.experimental_thread_pool = self._workers  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(
            unary, request_deserializer=method.request_deserializer,
            response_serializer=method.response_serializer)


def _release_at_end(context: Any, slot: CallSlot) -> None:
    if not context.add_callback(slot.release):
        slot.release()  # the call has already ended


class KeyedService(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc is untyped
    """A service whose every call is authenticated and admitted before it takes a thread.

    Args:
        service: the full service name (``kvgate.v1.Gateway``).
        methods: method name to its ``KeyedMethod``.
        gate: authentication and admission.
        is_admin_only: every method needs an admin key.
    """

    def __init__(self, service: str, methods: Mapping[str, KeyedMethod], gate: CallGate, *,
                 is_admin_only: bool) -> None:
        self._name = service
        self._methods = {f"/{service}/{name}": method for name, method in methods.items()}
        self._gate = gate
        self._is_admin_only = is_admin_only

    def service_name(self) -> str:
        return self._name

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        method = self._methods.get(handler_call_details.method)
        if method is None:
            return None
        return self._gate.handler(method, handler_call_details.invocation_metadata,
                                  is_admin_only=self._is_admin_only)


@dataclass(slots=True)
class _Lane:
    """A public service's pool and its count of calls in flight."""

    name: str
    pool: futures.ThreadPoolExecutor
    max_calls: int
    num_calls: int = 0


class PublicServicesGate(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Runs the services that need no key (health, reflection) on pools of their own, capped.

    Args:
        lanes: service name (``grpc.health.v1.Health``) to (pool, most calls in flight).
        watchdog: the body timeout, for their first request message.
        refusal_pool: where over-cap calls are refused.
    """

    def __init__(self, lanes: Mapping[str, tuple[futures.ThreadPoolExecutor, int]],
                 watchdog: BodyWatchdog, refusal_pool: futures.ThreadPoolExecutor) -> None:
        self._lanes = {name: _Lane(name, pool, cap) for name, (pool, cap) in lanes.items()}
        self._watchdog = watchdog
        self._refusals = refusal_pool
        self._lock = threading.Lock()

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        service = handler_call_details.method.lstrip("/").split("/", 1)[0]
        lane = self._lanes.get(service)
        if lane is None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        with self._lock:
            if lane.num_calls >= lane.max_calls:
                return refusal(Overloaded(
                    f"{lane.max_calls} {service} calls are in flight; retry shortly"),
                    self._refusals)
            lane.num_calls += 1
        return self._wrapped(handler, lane)

    def _leave(self, lane: _Lane) -> Callable[[], None]:
        is_done = threading.Event()

        def leave() -> None:
            with self._lock:
                if not is_done.is_set():
                    is_done.set()
                    lane.num_calls -= 1

        return leave

    def _wrapped(self, handler: grpc.RpcMethodHandler, lane: _Lane) -> grpc.RpcMethodHandler:
        watchdog = self._watchdog
        leave = self._leave(lane)
        options = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}

        def watched(requests: Iterator[Any], context: Any) -> Iterator[Any]:
            yield watchdog.first_message(requests, context)
            yield from requests

        if not handler.request_streaming and not handler.response_streaming:
            inner = handler.unary_unary

            def unary_unary(requests: Iterator[Any], context: Any) -> Any:
                try:
                    return inner(watchdog.first_message(requests, context), context)
                finally:
                    leave()

            unary_unary.experimental_thread_pool = lane.pool  # type: ignore[attr-defined]
            return grpc.stream_unary_rpc_method_handler(unary_unary, **options)
        if not handler.request_streaming:
            inner = handler.unary_stream
            if getattr(inner, "experimental_non_blocking", False):
                def non_blocking(requests: Iterator[Any], context: Any,
                                 send_response_callback: Any = None) -> None:
                    try:
                        inner(watchdog.first_message(requests, context), context,
                              send_response_callback)
                    finally:
                        leave()

                non_blocking.experimental_non_blocking = True  # type: ignore[attr-defined]
                non_blocking.experimental_thread_pool = lane.pool  # type: ignore[attr-defined]
                return grpc.stream_stream_rpc_method_handler(non_blocking, **options)

            def unary_stream(requests: Iterator[Any], context: Any) -> Iterator[Any]:
                _leave_at_end(context, leave)
                return _finally(
                    inner(watchdog.first_message(requests, context), context), leave)

            unary_stream.experimental_thread_pool = lane.pool  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(unary_stream, **options)
        if not handler.response_streaming:
            stream_inner = handler.stream_unary

            def stream_unary(requests: Iterator[Any], context: Any) -> Any:
                try:
                    return stream_inner(watched(requests, context), context)
                finally:
                    leave()

            stream_unary.experimental_thread_pool = lane.pool  # type: ignore[attr-defined]
            return grpc.stream_unary_rpc_method_handler(stream_unary, **options)
        bidi_inner = handler.stream_stream

        def stream_stream(requests: Iterator[Any], context: Any) -> Iterator[Any]:
            _leave_at_end(context, leave)
            return _finally(bidi_inner(watched(requests, context), context), leave)

        stream_stream.experimental_thread_pool = lane.pool  # type: ignore[attr-defined]
        return grpc.stream_stream_rpc_method_handler(stream_stream, **options)


def _leave_at_end(context: Any, leave: Callable[[], None]) -> None:
    if not context.add_callback(leave):
        leave()


def _finally(responses: Iterator[Any], done: Callable[[], None]) -> Iterator[Any]:
    try:
        yield from responses
    finally:
        done()

