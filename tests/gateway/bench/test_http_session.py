"""A benchmark user's HTTP session in front of a router that restarts: a request no model saw
(refused, or routed nowhere) is sent again within its window; one that was answered with a
real error is not. A real stdlib HTTP server on loopback plays the router's OpenAI front."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from gateway.bench.load_clients import HttpSession
from gateway.bench.peer_serve import Unanswered
from gateway.bench.rows import BenchError
from tests.redis_harness import free_port

MESSAGES = [{"role": "user", "content": "hi"}]


class _Router(http.server.BaseHTTPRequestHandler):
    """Answers ``statuses`` in turn (a 404 ``model_not_found``, a 400...), then a stream."""

    statuses: list[int] = []
    num_requests = 0
    bodies: list[dict[str, object]] = []

    def do_POST(self) -> None:  # noqa: N802 -- the stdlib's name
        type(self).bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        type(self).num_requests += 1
        if self.statuses:
            status = self.statuses.pop(0)
            body = json.dumps({"error": {"code": "model_not_found" if status == 404
                                         else "bad_request"}}).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        chunks = [{"choices": [{"delta": {"content": "hello"}}]},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]
        body = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
        body += b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def router_port() -> Iterator[int]:
    _Router.statuses, _Router.num_requests, _Router.bodies = [], 0, []
    yield free_port()


def _serve(port: int) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_request_refused_while_the_router_is_away_is_sent_again_once_it_listens(
        router_port: int) -> None:
    session = HttpSession("127.0.0.1", router_port, max_tokens=1, timeout_s=10,
                          resend_within_s=30)
    timer = threading.Timer(0.5, lambda: servers.append(_serve(router_port)))
    servers: list[http.server.ThreadingHTTPServer] = []
    timer.start()
    try:
        reply = session.chat(MESSAGES)
    finally:
        timer.join()
        for server in servers:
            server.shutdown()
            server.server_close()
        session.close()
    assert reply.text == "hello"
    assert session.num_resent == 1 and _Router.num_requests == 1  # one request, sent again


def test_a_request_the_router_routed_nowhere_is_sent_again(router_port: int) -> None:
    _Router.statuses = [404, 503]
    server = _serve(router_port)
    session = HttpSession("127.0.0.1", router_port, max_tokens=1, timeout_s=10,
                          resend_within_s=30)
    try:
        reply = session.chat(MESSAGES)
    finally:
        session.close()
        server.shutdown()
        server.server_close()
    assert reply.text == "hello" and _Router.num_requests == 3
    assert session.num_resent == 1  # one request, sent three times


def test_an_error_answer_is_not_sent_again(router_port: int) -> None:
    _Router.statuses = [400]
    server = _serve(router_port)
    session = HttpSession("127.0.0.1", router_port, max_tokens=1, timeout_s=10,
                          resend_within_s=30)
    try:
        with pytest.raises(BenchError, match="answered 400") as raised:
            session.chat(MESSAGES)
    finally:
        session.close()
        server.shutdown()
        server.server_close()
    assert not isinstance(raised.value, Unanswered)
    assert session.num_resent == 0 and _Router.num_requests == 1


def test_without_a_window_an_unanswered_request_fails_at_once(router_port: int) -> None:
    session = HttpSession("127.0.0.1", router_port, max_tokens=1, timeout_s=10)
    with pytest.raises(Unanswered, match="answered nothing"):
        session.chat(MESSAGES)
    assert session.num_resent == 0


def test_a_servers_own_fields_go_with_every_request(router_port: int) -> None:
    server = _serve(router_port)
    try:
        session = HttpSession("127.0.0.1", router_port, max_tokens=4, timeout_s=5,
                              model="kvgate-bench", extra_body={"ignore_eos": True})
        session.chat(MESSAGES)
        session.chat(MESSAGES)
        session.close()
    finally:
        server.shutdown()
        server.server_close()
    assert [(b["ignore_eos"], b["model"], b["max_tokens"]) for b in _Router.bodies] == [
        (True, "kvgate-bench", 4)] * 2


def test_without_own_fields_a_request_is_openais_alone(router_port: int) -> None:
    server = _serve(router_port)
    try:
        session = HttpSession("127.0.0.1", router_port, max_tokens=4, timeout_s=5)
        session.chat(MESSAGES)
        session.close()
    finally:
        server.shutdown()
        server.server_close()
    assert "ignore_eos" not in _Router.bodies[0] and "model" not in _Router.bodies[0]
