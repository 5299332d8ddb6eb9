"""The wrapper every ``kvgate.v1`` RPC goes through, from the wire to a servicer method.

``ServicerSet.keyed_services`` turns both services of the proto into
``gateway.service.call_gate.KeyedService`` handlers, so that, in this order, a call

1. is authenticated and admitted on its headers, before it takes a worker thread
   (``gateway.service.call_gate``: no key, an unknown key, a tenant key on the Admin service, or
   a key over its limits, is refused at once without its body being read);
2. has its request message read within the body timeout;
3. is refused INVALID_ARGUMENT when its bytes did not parse as its message (instead of grpc's
   default INTERNAL for a deserialisation failure);
4. ends with the status of any exception raised inside
   (``gateway.service.status_mapping.status_of``); faults are logged with their traceback and an
   incident id. Prompts and keys are never logged;
5. leaves one access-log line when it ends, for Generate, Warm and Lookup
   (``gateway.service.access_log``; a generator closed early, the client gone, is CANCELLED).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from gateway.cache.operations.factory import CacheConfig
from gateway.config.keys import Principal
from gateway.core.errors import InvalidRequest
from gateway.service.access_log import AccessCall, AccessLog
from gateway.service.admin_servicer import AdminServicer
from gateway.service.admission import CallKind
from gateway.service.call_gate import CallGate, KeyedMethod, KeyedService
from gateway.service.edge import EdgeLimits
from gateway.service.engine_slot import EngineSlot
from gateway.service.pb import kvgate_pb2 as pb
from gateway.service.prompt_comparisons import PromptComparisons
from gateway.service.servicer import (
    ADMIN_SERVICE,
    GATEWAY_SERVICE,
    GatewayServicer,
)
from gateway.service.status_mapping import status_of

logger = logging.getLogger(__name__)

M = TypeVar("M")

KIND_OF_METHOD = {"Generate": CallKind.GENERATE, "Warm": CallKind.WARM,
                  "Lookup": CallKind.LOOKUP}
"""Gateway methods by what they do (admission); every Admin method is ``CallKind.ADMIN``."""


@dataclass(frozen=True, slots=True)
class _Malformed:
    """What a request whose bytes did not parse deserialises to."""

    message_type: str
    detail: str


def _deserializer(message_class: Any) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return _Malformed(message_class.DESCRIPTOR.full_name, str(exc))

    return parse


class ServicerSet:
    """Both services and their wrapped methods.

    Args:
        engines: where the engine will be once the model is loaded.
        limits: bounds on deadlines and TTLs.
        access: where Generate, Warm and Lookup leave their line (None: nowhere).
        tenants: the tenants with keys (``AdminServicer``; None: not checked).
        comparisons: the shapes of recent requests, shared with the HTTP front (None: the
            gRPC service's own, of ``[cache] block_tokens``' default).
    """

    def __init__(self, engines: EngineSlot, limits: EdgeLimits,
                 access: AccessLog | None = None, *,
                 tenants: frozenset[str] | None = None,
                 comparisons: PromptComparisons | None = None) -> None:
        self.gateway = GatewayServicer(
            engines, limits, comparisons if comparisons is not None
            else PromptComparisons(block_tokens=CacheConfig().block_tokens))
        self.admin = AdminServicer(engines, limits, tenants=tenants)
        self._access = access

    def keyed_services(self, gate: CallGate) -> tuple[KeyedService, KeyedService]:
        """One handler per service, every method behind ``gate``.

        Raises:
            RuntimeError: an RPC of the proto has no method here (a servicer out of date).
        """
        return (
            self._service(GATEWAY_SERVICE, self.gateway, gate, is_admin_only=False),
            self._service(ADMIN_SERVICE, self.admin, gate, is_admin_only=True),
        )

    def _service(self, service: str, servicer: object, gate: CallGate, *,
                 is_admin_only: bool) -> KeyedService:
        descriptor = pb.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[-1]]
        methods = {}
        for method in descriptor.methods:
            implementation = getattr(servicer, method.name, None)
            if implementation is None:
                raise RuntimeError(f"{type(servicer).__name__} does not implement {method.name}")
            full_name = f"/{service}/{method.name}"
            access = (self._access if not is_admin_only and method.name in KIND_OF_METHOD
                      else None)
            behavior = (_streaming(full_name, implementation, access) if method.server_streaming
                        else _unary(full_name, implementation, access))
            methods[method.name] = KeyedMethod(
                behavior=behavior,
                request_deserializer=_deserializer(getattr(pb, method.input_type.name)),
                response_serializer=getattr(pb, method.output_type.name).SerializeToString,
                response_streaming=method.server_streaming,
                kind=(CallKind.ADMIN if is_admin_only
                      else KIND_OF_METHOD.get(method.name, CallKind.OTHER)),
            )
        return KeyedService(service, methods, gate, is_admin_only=is_admin_only)


def _unary(name: str, implementation: Callable[..., M], access: AccessLog | None = None
           ) -> Callable[[object, Principal, Any], M]:
    def behavior(request: object, principal: Principal, context: Any) -> M:
        call = AccessCall(access, "grpc." + name.rsplit("/", 1)[-1], tenant=principal.tenant)
        with _statuses(context, name, call):
            _check_parsed(request, name)
            response = implementation(request, principal, context)
            _note_response(call, response)
            return response
        raise AssertionError("unreachable: _statuses aborts or re-raises")

    return behavior


def _streaming(name: str, implementation: Callable[..., Iterator[M]],
               access: AccessLog | None = None
               ) -> Callable[[object, Principal, Any], Iterator[M]]:
    def behavior(request: object, principal: Principal, context: Any) -> Iterator[M]:
        call = AccessCall(access, "grpc." + name.rsplit("/", 1)[-1], tenant=principal.tenant)
        with _statuses(context, name, call):
            _check_parsed(request, name)
            for message in implementation(request, principal, context):
                _note_response(call, message)
                yield message

    return behavior


def _check_parsed(request: object, name: str) -> None:
    if isinstance(request, _Malformed):
        raise InvalidRequest(
            f"the request is not a valid {request.message_type} protobuf "
            f"({request.detail}); send the message {name} expects"
        )


def _note_response(call: AccessCall, message: object) -> None:
    """Keep the counts of a response (a Generate's usage, a Warm's or a Lookup's answer)."""
    if isinstance(message, pb.GenerateResponse):
        if message.HasField("usage"):
            usage = message.usage
            call.note(prompt_tokens=usage.prompt_tokens,
                      cached_tokens_by_tier=dict(usage.cached_tokens_by_tier),
                      completion_tokens=usage.completion_tokens, ttft_ms=usage.ttft_ms,
                      finish=pb.FinishReason.Name(usage.finish_reason).removeprefix(
                          "FINISH_REASON_").lower(), lossy=usage.lossy)
    elif isinstance(message, pb.LookupResponse):
        call.note(prompt_tokens=message.prompt_tokens,
                  cached_tokens_by_tier=dict(message.cached_tokens_by_tier))
    elif isinstance(message, pb.WarmResponse):
        call.note(prompt_tokens=message.prompt_tokens)


@contextlib.contextmanager
def _statuses(context: Any, name: str, call: AccessCall | None = None) -> Iterator[None]:
    """End the call with the status of any exception raised inside (``status_of``), and
    leave ``call``'s access-log line."""
    ended = "CANCELLED"  # unless set below: a stream closed early, its client gone
    try:
        yield
        ended = "OK"
    except Exception as exc:
        status = status_of(exc)
        ended = status.code.name
        if status.is_fault:
            logger.error("%s failed (incident %s)", name, status.incident, exc_info=exc)
        else:
            logger.debug("%s from %s ended with %s", name, context.peer(), status.code.name)
        context.abort(status.code, status.message)
    finally:
        if call is not None:
            call.end(ended)
