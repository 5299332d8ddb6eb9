"""The one place that says which gRPC status code each gateway error becomes.

The engine, canonicalisation and authentication raise ``GatewayError`` subclasses whose
messages are written for a person; the servicer hands any exception to ``status_of`` and
aborts the call with what it returns. An error that is not in the table -- a bug, or a
``GatewayError`` that should never reach a client, such as ``IndexInvariantError`` -- becomes
``INTERNAL`` with a generic message and an incident id: the traceback is logged by the servicer
under that id, and nothing of the fault's text (which may quote a prompt) reaches the client.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import grpc

from gateway.core.errors import (
    DeadlineExceeded,
    EngineDraining,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    QueueFull,
    RequestCancelled,
    Unauthenticated,
)

STATUS_OF_ERROR: dict[type, grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,  # CanonicalizationError included
    NotFound: grpc.StatusCode.NOT_FOUND,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    RequestCancelled: grpc.StatusCode.CANCELLED,
    EngineDraining: grpc.StatusCode.UNAVAILABLE,
}
"""Expected errors by class; a subclass takes the code of its nearest listed ancestor."""

_FALLBACK_MESSAGES = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: "the gateway is overloaded; retry after a short wait",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the deadline passed before the request finished",
    grpc.StatusCode.CANCELLED: "the request was cancelled",
    grpc.StatusCode.UNAVAILABLE: "the gateway is not serving; retry shortly or on another replica",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Status:
    """What a call ends with.

    Attributes:
        code: the gRPC status code.
        message: the status message sent to the client.
        incident: for faults (``INTERNAL``), the id that the client sees and the log line
            carries; None for expected errors.
    """

    code: grpc.StatusCode
    message: str
    incident: str | None = None

    @property
    def is_fault(self) -> bool:
        return self.incident is not None


def status_of(exc: BaseException) -> Status:
    """The status a call that raised ``exc`` ends with."""
    for cls in type(exc).__mro__:
        code = STATUS_OF_ERROR.get(cls)
        if code is not None:
            message = str(exc) or _FALLBACK_MESSAGES.get(code, code.name.lower())
            return Status(code=code, message=message)
    incident = secrets.token_hex(6)
    return Status(
        code=grpc.StatusCode.INTERNAL,
        message=(f"internal error (incident {incident}, logged by the gateway); retry, and "
                 "report the incident id to the operator if it happens again"),
        incident=incident,
    )
