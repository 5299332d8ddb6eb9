"""A gRPC client pointed at an HTTP port is told so (issue 26, item 5).

Real servers on free loopback ports: the HTTP front (uvicorn, no model needed: the refusal is
below the application), and prometheus-client's own HTTP/1.x server (the ``[metrics]`` port)
for a server that knows nothing of gRPC. The clients are the real ``KvgateClient``, the real
``kvgate generate`` (in process) and a raw socket.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator

import grpc
import pytest

from gateway.cli.main import main
from gateway.client import KvgateClient, KvgateError, NotGrpc, RetryPolicy
from gateway.config.settings import HttpSettings, ServeConfig
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.grpc_refusal import PREFACE, GrpcRefusal
from gateway.service.http.server import HttpFront
from gateway.service.metrics import GatewayMetrics
from tests.gateway.grpc_harness import KEY_A, KEYS

GRPC_PORT = 50999
"""The gRPC port the front's configuration names (nothing listens there: only named)."""


@pytest.fixture
def front() -> Iterator[HttpFront]:
    config = ServeConfig(host="127.0.0.1", port=GRPC_PORT, keys=KEYS,
                         http=HttpSettings(port=0))
    started = HttpFront(config, Authenticator(KEYS), EngineSlot())
    started.start()
    try:
        yield started
    finally:
        started.stop(timeout_s=5.0)


def test_kvgate_generate_on_the_http_port_says_where_grpc_listens(
    front: HttpFront, capsys: pytest.CaptureFixture[str],
) -> None:
    began = time.monotonic()
    status = main(["generate", "--port", str(front.port), "--api-key", KEY_A,
                   "--timeout", "20", "hi"])
    err = capsys.readouterr().err
    assert status == 1
    assert f"127.0.0.1:{front.port} is kvgate's OpenAI-compatible HTTP API (HTTP/1.1), not " \
           f"gRPC: kvgate's gRPC service listens on port {GRPC_PORT}" in err, err
    assert "Failed parsing HTTP/2" not in err
    assert time.monotonic() - began < 10  # answered, not retried until the deadline


def test_the_client_gets_unimplemented_and_the_front_still_serves_http(
        front: HttpFront) -> None:
    assert front.port is not None
    with KvgateClient("127.0.0.1", front.port, KEY_A, timeout_s=20) as client, \
            pytest.raises(KvgateError) as excinfo:
        client.lookup("hi")
    assert excinfo.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "OpenAI-compatible HTTP API" in excinfo.value.details
    connection = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 503 and json.loads(response.read())["status"] == "loading"
    finally:
        connection.close()


def test_a_preface_split_over_reads_is_still_answered_in_http2(front: HttpFront) -> None:
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as sock:
        sock.sendall(PREFACE[:5])  # "PRI *": not enough to tell HTTP/1.1 from HTTP/2
        time.sleep(0.2)
        sock.sendall(PREFACE[5:])
        head = _read(sock, 9)
    assert head == bytes((0, 0, 0, 0x4, 0, 0, 0, 0, 0))  # the server's empty SETTINGS frame


def test_a_plain_http_server_gives_a_not_grpc_error_naming_the_address() -> None:
    metrics = GatewayMetrics()
    port = metrics.start("127.0.0.1", 0)
    try:
        began = time.monotonic()
        with KvgateClient("127.0.0.1", port, KEY_A, timeout_s=20,
                          retry=RetryPolicy(max_attempts=4)) as client, \
                pytest.raises(NotGrpc) as excinfo:
            client.lookup("hi")
        assert time.monotonic() - began < 5  # not retried
    finally:
        metrics.stop()
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    assert f"127.0.0.1:{port} answered HTTP/1.x, not gRPC" in str(excinfo.value)
    assert "50051" in str(excinfo.value)


def test_the_refusal_answers_the_first_call_with_a_long_percent_encoded_message() -> None:
    message = "100% wrong port: " + "x" * 300 + " é"
    refusal = GrpcRefusal(message)
    settings = bytes((0, 0, 0, 0x4, 0, 0, 0, 0, 0))
    headers = bytes((0, 0, 1, 0x1, 0x4, 0, 0, 0, 3)) + b"\x82"  # stream 3, ":method: GET"
    out = refusal.feed(PREFACE + settings + headers)
    assert refusal.is_done
    ack, rest = out[:9], out[9:]
    assert ack == bytes((0, 0, 0, 0x4, 0x1, 0, 0, 0, 0))
    length = int.from_bytes(rest[:3], "big")
    assert rest[3:9] == bytes((0x1, 0x5, 0, 0, 0, 3))  # HEADERS, END_STREAM|END_HEADERS
    block = rest[9:9 + length]
    assert b"grpc-status\x0212" in block
    assert b"100%25 wrong port: " + b"x" * 300 + b" %C3%A9" in block
    goaway = rest[9 + length:]
    assert goaway[3] == 0x7 and goaway[9:] == bytes((0, 0, 0, 3, 0, 0, 0, 0))


def _read(sock: socket.socket, num_bytes: int) -> bytes:
    data = b""
    while len(data) < num_bytes:
        chunk = sock.recv(num_bytes - len(data))
        if not chunk:
            break
        data += chunk
    return data
