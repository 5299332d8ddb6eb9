"""Domain errors → gRPC status codes, from the one table that decides it."""

from __future__ import annotations

import grpc
import pytest

from gateway.core.errors import (
    CanonicalizationError,
    DeadlineExceeded,
    EngineDraining,
    GatewayError,
    IndexInvariantError,
    InvalidRequest,
    PermissionDenied,
    QueueFull,
    RequestCancelled,
    Unauthenticated,
)
from gateway.service.status_mapping import STATUS_OF_ERROR, status_of


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest("max_tokens must be between 1 and 8192"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (CanonicalizationError("`prompt` is empty"), grpc.StatusCode.INVALID_ARGUMENT),
        (Unauthenticated("no API key"), grpc.StatusCode.UNAUTHENTICATED),
        (PermissionDenied("needs an admin key"), grpc.StatusCode.PERMISSION_DENIED),
        (QueueFull("64 requests are already waiting"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DeadlineExceeded("past its deadline"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (RequestCancelled("cancelled"), grpc.StatusCode.CANCELLED),
        (EngineDraining("shutting down"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_expected_errors_keep_their_message(error: Exception, code: grpc.StatusCode) -> None:
    status = status_of(error)
    assert status.code == code
    assert status.message == str(error)
    assert not status.is_fault


def test_an_empty_message_gets_a_useful_default() -> None:
    assert "retry" in status_of(QueueFull()).message


@pytest.mark.parametrize(
    "error",
    [RuntimeError("tensor shape mismatch in 'my secret prompt'"),
     IndexInvariantError("refcount of block ab12 went negative"),
     GatewayError("a gateway error nobody mapped"),
     KeyError("k")],
)
def test_faults_are_internal_with_an_incident_id_and_no_detail(error: Exception) -> None:
    status = status_of(error)
    assert status.code == grpc.StatusCode.INTERNAL
    assert status.is_fault and status.incident is not None
    assert status.incident in status.message
    assert str(error) not in status.message and "secret" not in status.message
    assert status_of(error).incident != status.incident  # one id per occurrence


def test_every_engine_error_of_the_requests_contract_is_mapped() -> None:
    for cls in (InvalidRequest, QueueFull, RequestCancelled, DeadlineExceeded, EngineDraining,
                Unauthenticated, PermissionDenied):
        assert cls in STATUS_OF_ERROR
