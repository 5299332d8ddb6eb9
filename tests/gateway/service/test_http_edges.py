"""The HTTP front's edges under hostile clients, over real sockets (issue 22, "Edges with
deadlines").

Each test starts its own ``HttpFront`` on a free loopback port, with the deadlines and caps it
needs (fractions of a second, so that the suite stays fast), over one engine on the tiny Llama
shared by the module. Clients are raw sockets or ``http.client``: they send what an SDK never
would -- nothing at all, half a head, half a body.

What each test would have seen before (dd92bc1): idle connections were never closed and, past
``max_connections``, every request got 503; a stalled body held its key's call slot forever
(429 for the key's next request); a big body was parsed and walked on the event loop; a lone
surrogate in a JSON key was a 500.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest

import gateway.service.http.app as app_module
from gateway.config.limits import LimitSettings
from gateway.config.settings import HttpSettings, ServeConfig
from gateway.service.admission import Admission
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.connections import (
    ConnectionGuard,
    ConnectionLimits,
    limits_within,
)
from gateway.service.http.openai_requests import parse_call as real_parse_call
from gateway.service.http.server import HttpFront
from tests.gateway.grpc_harness import KEY_A, KEY_B, KEYS, start_gateway, tiny_model, wait_until

MODEL = "model"
CHAT = json.dumps({"model": MODEL, "max_tokens": 1,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()
BOUND_S = 10.0
"""How long a test waits for what should happen within a fraction of a second: generous, so
that a loaded machine never fails a test that holds."""


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSlot]:
    slot = EngineSlot()
    running = start_gateway(tiny_model(tmp_path_factory.mktemp("tiny") / MODEL), engines=slot)
    try:
        yield slot
    finally:
        running.stop()


@contextmanager
def serving(engines: EngineSlot, *, admission: Admission | None = None,
            limits: LimitSettings | None = None, **http: Any) -> Iterator[HttpFront]:
    config = ServeConfig(host="127.0.0.1", port=0, keys=KEYS, limits=limits or LimitSettings(),
                         http=HttpSettings(port=0, **http))
    front = HttpFront(config, Authenticator(KEYS), engines, admission)
    front.start()
    try:
        yield front
    finally:
        front.stop(timeout_s=5.0)


def ask(front: HttpFront, method: str, path: str, body: bytes | None = None,
        key: str | None = KEY_A) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=BOUND_S)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def connect(front: HttpFront) -> socket.socket:
    return socket.create_connection(("127.0.0.1", front.port), timeout=BOUND_S)


def until_closed(sock: socket.socket, timeout_s: float = BOUND_S) -> bytes | None:
    """What the server sent before it closed ``sock``; None if it was still open after
    ``timeout_s``."""
    received = b""
    end = time.monotonic() + timeout_s
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return received
        if not data:
            return received
        received += data
    return None


def is_closed_now(sock: socket.socket) -> bool:
    """The server has closed ``sock`` (it reads as end of file), without waiting."""
    sock.settimeout(0.0)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(BOUND_S)


def head(path: str, *, length: int, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), KEY_A.encode(), length, extra))


# ---- connections that send no request ------------------------------------------------------


def test_connections_without_a_whole_request_head_are_closed_within_the_header_timeout(
    engines: EngineSlot,
) -> None:
    with serving(engines, header_timeout_s=0.3) as front, ExitStack() as stack:
        silent = [stack.enter_context(connect(front)) for _ in range(5)]
        trickling = stack.enter_context(connect(front))
        trickling.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        while time.monotonic() - started < 1.5:  # bytes that keep coming do not reset the clock
            try:
                trickling.sendall(b"X-Pad: y\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.05)
        assert until_closed(trickling) is not None, "a head that never ends was not cut"
        for sock in silent:
            assert until_closed(sock) == b"", "a silent connection was not closed"
        assert wait_until(lambda: front.guard is not None and front.guard.num_open == 0)
        assert front.guard is not None and front.guard.num_closed_late == 6


def test_a_kept_alive_connection_is_closed_once_idle_and_a_body_nobody_reads_with_it(
    engines: EngineSlot,
) -> None:
    with serving(engines, header_timeout_s=0.3) as front:
        with connect(front) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            first = sock.recv(65536)
            sock.sendall(b"GET /hea")  # the next head, never finished
            rest = until_closed(sock)
        assert rest is not None, "a kept-alive connection that trickles was not closed"
        assert (first + rest).startswith(b"HTTP/1.1 200 "), first
        with connect(front) as sock:  # /health answers without reading the body that never comes
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            answer = until_closed(sock)
        assert answer is not None and answer.startswith(b"HTTP/1.1 200 "), answer
        assert ask(front, "GET", "/health")[0] == 200


def test_idle_connections_over_the_caps_never_turn_a_keyed_request_or_health_away(
    engines: EngineSlot,
) -> None:
    # Only settings that existed before: the caps must close idle connections, not refuse
    # requests (before: 503 for everyone once max_connections connections were open).
    with serving(engines, max_connections=32) as front, ExitStack() as stack:
        idle = [stack.enter_context(connect(front)) for _ in range(80)]
        assert wait_until(lambda: sum(map(is_closed_now, idle)) >= 80 - 32), \
            "the server closed none of the idle connections over max_connections"
        assert ask(front, "GET", "/health", key=None)[0] == 200
        status, body = ask(front, "GET", "/v1/models")
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL
        assert ask(front, "POST", "/v1/chat/completions", CHAT)[0] == 200
        open_idle = [sock for sock in idle if not is_closed_now(sock)]
        assert len(open_idle) <= 32
        assert idle[0] not in open_idle, "the longest-waiting connection is closed first"


def test_waiting_connections_have_a_cap_of_their_own(engines: EngineSlot) -> None:
    with serving(engines, max_connections=64, max_waiting_connections=4,
                 header_timeout_s=30.0) as front, ExitStack() as stack:
        idle = [stack.enter_context(connect(front)) for _ in range(12)]
        assert wait_until(lambda: sum(map(is_closed_now, idle)) == 8)
        assert [is_closed_now(sock) for sock in idle] == [True] * 8 + [False] * 4
        assert front.guard is not None and front.guard.num_closed_over_cap == 8
        assert ask(front, "POST", "/v1/chat/completions", CHAT)[0] == 200


def test_the_guard_closes_the_longest_waiting_connection_and_never_a_busy_one() -> None:
    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name
            self.is_dropped = False

        def drop(self) -> None:
            self.is_dropped = True

    guard = ConnectionGuard(ConnectionLimits(max_connections=3, max_waiting=2,
                                             header_timeout_s=1.0, body_timeout_s=1.0))
    a, b, c, d, e = (Fake(name) for name in "abcde")
    calls: Any = guard  # the guard takes protocols; these fakes have the one method it calls
    for conn in (a, b):
        calls.opened(conn)
        calls.waiting(conn)
    calls.busy(a)
    calls.opened(c)
    calls.waiting(c)  # b, c wait: at the cap of 2
    assert not any(x.is_dropped for x in (a, b, c))
    calls.waiting(a)  # a is done with its answer and waits again: b has waited longest
    assert [x.is_dropped for x in (a, b, c)] == [False, True, False]
    calls.busy(a)
    calls.busy(c)
    calls.opened(d)  # a, c, d open: at max_connections
    calls.waiting(d)
    calls.opened(e)  # one more: d is the only one waiting
    assert d.is_dropped and not e.is_dropped
    calls.waiting(e)
    calls.busy(e)
    f = Fake("f")
    calls.opened(f)  # every connection busy: the new one goes
    assert f.is_dropped and guard.num_open == 3 and guard.num_waiting == 0


def test_max_connections_is_sized_under_the_open_file_limit() -> None:
    settings = HttpSettings(max_connections=1024, max_waiting_connections=256)
    assert limits_within(settings, None).max_connections == 1024
    assert limits_within(settings, 65536).max_connections == 1024
    lowered = limits_within(settings, 1024)
    assert (lowered.max_connections, lowered.max_waiting) == (512, 256)
    tiny = limits_within(settings, 300)
    assert (tiny.max_connections, tiny.max_waiting) == (150, 150)


# ---- bodies ----------------------------------------------------------------------------------


def test_a_stalled_body_holds_no_call_slot(engines: EngineSlot) -> None:
    # Before: the slot was taken on the headers, so the key's next request got 429.
    limits = LimitSettings(max_calls_per_key=1)
    admission = Admission(limits)
    with serving(engines, admission=admission, limits=limits) as front, connect(front) as sock:
        sock.sendall(head("/v1/chat/completions", length=len(CHAT),
                          extra=b"Expect: 100-continue\r\n"))
        assert sock.recv(64).startswith(b"HTTP/1.1 100 ")  # the front is reading the body
        sock.sendall(CHAT[:10])  # ... and half of it comes
        status, body = ask(front, "POST", "/v1/chat/completions", CHAT)
        assert status == 200, body
        assert admission.snapshot().calls == 0


def test_a_tenant_past_its_pending_bodies_gets_429_and_another_tenant_is_served(
        engines: EngineSlot) -> None:
    with serving(engines, max_pending_bodies_per_tenant=2) as front, \
            connect(front) as first, connect(front) as second:
        for sock in (first, second):  # tenant A's two bodies, stalled half way
            sock.sendall(head("/v1/chat/completions", length=len(CHAT),
                              extra=b"Expect: 100-continue\r\n"))
            assert sock.recv(64).startswith(b"HTTP/1.1 100 ")
            sock.sendall(CHAT[:10])
        status, body = ask(front, "POST", "/v1/chat/completions", CHAT)
        assert status == 429, body
        error = json.loads(body)["error"]
        assert "max_pending_bodies_per_tenant" in error["message"]
        assert ask(front, "POST", "/v1/chat/completions", CHAT, key=KEY_B)[0] == 200
    with serving(engines, max_pending_bodies_per_tenant=2) as front:  # bodies that end free it
        assert [ask(front, "POST", "/v1/chat/completions", CHAT)[0] for _ in range(3)] == \
            [200] * 3


def test_a_stalled_body_is_cut_with_408_and_the_connection_closed(engines: EngineSlot) -> None:
    with serving(engines, body_timeout_s=0.3) as front:
        with connect(front) as stalled, connect(front) as chunked:
            stalled.sendall(head("/v1/completions", length=1000) + b'{"model": "mo')
            chunked.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Authorization: Bearer " + KEY_A.encode() + b"\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"mod\r\n")
            for sock in (stalled, chunked):
                answer = until_closed(sock)
                assert answer is not None, "a stalled body was not cut"
                assert answer.startswith(b"HTTP/1.1 408 "), answer
                error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
                assert error["code"] == "request_timeout" and "body_timeout_s" in error["message"]
        assert ask(front, "POST", "/v1/chat/completions", CHAT)[0] == 200


def test_a_million_token_ids_are_parsed_off_the_event_loop_and_refused_by_length(
    engines: EngineSlot, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A barrier in the validation of the big body: it waits until another request has been
    # answered. On the event loop it would wait in vain (nothing else runs meanwhile).
    validating, answered = threading.Event(), threading.Event()
    was_answered: list[bool] = []

    def parse_call(*args: Any, **kwargs: Any) -> Any:
        validating.set()
        was_answered.append(answered.wait(timeout=3 * BOUND_S))
        return real_parse_call(*args, **kwargs)

    monkeypatch.setattr(app_module, "parse_call", parse_call)
    body = json.dumps({"model": MODEL, "prompt": [1] * 10**6, "max_tokens": 1}).encode()
    assert len(body) < HttpSettings().max_body_bytes
    outcome: list[tuple[int, bytes]] = []
    with serving(engines) as front:
        big = threading.Thread(target=lambda: outcome.append(
            ask(front, "POST", "/v1/completions", body)))
        big.start()
        try:
            assert validating.wait(timeout=BOUND_S)
            status, _ = ask(front, "GET", "/v1/models")
            assert status == 200
            answered.set()
        finally:
            answered.set()
            big.join(timeout=3 * BOUND_S)
    assert was_answered == [True]
    status, answer = outcome[0]
    error = json.loads(answer)["error"]
    assert status == 400 and error["param"] == "prompt", error
    assert "1000000 items" in error["message"] and "max_prompt_chars" in error["message"]


# ---- what a client sends back to it ----------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [
    (b'{"model": "model", "\\ud800": 1, "messages": [{"role": "user", "content": "hi"}]}',
     "\\ud800"),
    (b'{"model": "model", "messages": [{"role": "user", "content": "hi", "x\\udfff": 1}]}',
     "messages[0].x\\udfff"),
])
def test_a_lone_surrogate_in_a_json_key_is_400_naming_it_escaped(
    engines: EngineSlot, body: bytes, param: str,
) -> None:
    with serving(engines) as front:
        status, answer = ask(front, "POST", "/v1/chat/completions", body)
        assert status == 400, answer
        error = json.loads(answer)["error"]
        assert error["param"] == param and param in error["message"]
        assert ask(front, "POST", "/v1/chat/completions", CHAT)[0] == 200
