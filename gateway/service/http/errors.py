"""Errors of the HTTP front as OpenAI shapes them: JSON ``{"error": {...}}`` and an HTTP status.

The gateway's errors become statuses in one place, ``gateway.service.status_mapping.status_of``
(the gRPC code of each error class); this module only says which HTTP status and OpenAI error
``type`` each gRPC code is, so the two surfaces can never disagree about what an error means.
Errors only HTTP has (a body over the limit, a body that is not JSON, an unknown model or path)
are ``HttpFailure``\\ s raised by the front itself.

    gRPC code            HTTP  OpenAI type
    INVALID_ARGUMENT      400  invalid_request_error     (``param`` names the field, if known)
    UNAUTHENTICATED       401  authentication_error
    PERMISSION_DENIED     403  permission_error
    RESOURCE_EXHAUSTED    429  rate_limit_error          + Retry-After
    UNAVAILABLE           503  service_unavailable_error + Retry-After
    DEADLINE_EXCEEDED     504  timeout_error
    CANCELLED             499  cancelled                 (nobody is left to read it)
    INTERNAL              500  server_error              (an incident id; the fault is logged)

The ``code`` of every error is the gRPC status name in lower case (``invalid_argument``,
``resource_exhausted``...), so a log line from either surface reads the same.

A message may quote what the client sent (an unknown field's name), and JSON lets a client send
a lone surrogate (``{"\\ud800": 1}``), which UTF-8 cannot carry: such characters are written as
their escape, so that the answer is the 400 it should be and not a failure to encode it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc

from gateway.core.errors import InvalidRequest
from gateway.service.status_mapping import status_of

logger = logging.getLogger(__name__)

HTTP_OF_CODE: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.INTERNAL: (500, "server_error"),
}
"""HTTP status and OpenAI error type of each gRPC code ``status_of`` can return."""

RETRY_AFTER_STATUSES = frozenset({429, 503})
CLOSE_STATUSES = frozenset({408})
"""Answers after which the connection is closed: the rest of the request never came."""


class InvalidParam(InvalidRequest):
    """An OpenAI request field the front cannot accept (400); ``param`` names it.

    Args:
        param: the field, as the client wrote it (``messages[2].content``, ``n``).
        message: what was wrong and what would be accepted.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class HttpFailure(Exception):
    """An error only the HTTP surface has (it has no gRPC code).

    NOTE: a plain class, not a frozen dataclass: the interpreter and anyio assign
    ``__traceback__`` and ``__context__`` to exceptions in flight.

    Args:
        status: the HTTP status.
        type: the OpenAI error type.
        message: what was wrong and what to change.
        code: OpenAI's ``code`` (``request_too_large``, ``model_not_found``...).
        param: the field at fault, if one is.
    """

    def __init__(self, *, status: int, type: str, message: str, code: str,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorAnswer:
    """What an error becomes on the wire: status, the OpenAI JSON body, extra headers."""

    status: int
    body: dict[str, object]
    headers: dict[str, str] = field(default_factory=dict)


def error_answer(exc: BaseException, *, where: str, retry_after_s: int) -> ErrorAnswer:
    """The answer to a request that failed with ``exc``; faults are logged under an incident id.

    Args:
        exc: what was raised.
        where: the route, for the log line.
        retry_after_s: the ``Retry-After`` of a 429 or 503.
    """
    param: str | None = None
    if isinstance(exc, HttpFailure):
        status, kind, message, code, param = (exc.status, exc.type, exc.message, exc.code,
                                              exc.param)
    else:
        grpc_status = status_of(exc)
        status, kind = HTTP_OF_CODE.get(grpc_status.code, (500, "server_error"))
        message, code = grpc_status.message, grpc_status.code.name.lower()
        if isinstance(exc, InvalidParam):
            param = exc.param
        if grpc_status.is_fault:
            logger.error("%s failed (incident %s)", where, grpc_status.incident, exc_info=exc)
    if status < 500:
        logger.debug("%s ended with %d %s", where, status, code)
    headers = {"Retry-After": str(retry_after_s)} if status in RETRY_AFTER_STATUSES else {}
    if status in CLOSE_STATUSES:
        headers["Connection"] = "close"
    body: dict[str, object] = {"error": {
        "message": _encodable(message), "type": kind,
        "param": None if param is None else _encodable(param), "code": code}}
    return ErrorAnswer(status=status, body=body, headers=headers)


def _encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot carry (lone surrogates) written as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
