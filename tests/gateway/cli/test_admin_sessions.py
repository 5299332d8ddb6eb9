"""Sessions end to end: ``session_id`` on Generate, ``X-Session-Id`` (and ``user``, where
configured) over HTTP, ``kvgate admin sessions ls | reset`` and the Admin RPCs, against a real
gateway (tiny Llama, 16-token blocks) with the OpenAI front on the same engine.

What a reset drops on every tier and Redis: ``tests/gateway/engine/test_sessions.py``; across
two replicas: ``tests/gateway/service/test_session_replicas.py``.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gateway.cli.main import main
from gateway.client import KvgateClient, KvgateError
from gateway.config.settings import HttpSettings, ServeConfig
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.server import HttpFront
from tests.gateway.cli.test_admin_cli import _admin
from tests.gateway.grpc_harness import (
    ADMIN_KEY,
    KEY_A,
    KEY_B,
    KEYS,
    LONG_PROMPT,
    RunningGateway,
    start_gateway,
    tiny_model,
)

SYSTEM = [{"role": "system", "content": LONG_PROMPT}]


class Stack:
    """The gateway, and two HTTP fronts on its engine: one with ``[http] session_from_user``."""

    def __init__(self, running: RunningGateway, fronts: dict[bool, HttpFront]) -> None:
        self.running = running
        self.fronts = fronts

    def admin(self) -> KvgateClient:
        return self.running.client(ADMIN_KEY)

    def chat(self, content: str, *, headers: dict[str, str] | None = None,
             from_user: bool = False, **fields: Any) -> tuple[int, dict[str, Any]]:
        """POST /v1/chat/completions under the system prompt, as tenant a."""
        body = {"model": "model", "max_tokens": 2,
                "messages": [*SYSTEM, {"role": "user", "content": content}], **fields}
        conn = http.client.HTTPConnection("127.0.0.1", self.fronts[from_user].port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Authorization": f"Bearer {KEY_A}",
                                  "Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def sessions(self, tenant: str | None = None) -> dict[str, str]:
        """session id -> tenant, as ListSessions answers."""
        return {s.session_id: s.tenant for s in self.admin().list_sessions(tenant=tenant)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    engines = EngineSlot()
    running = start_gateway(tiny_model(tmp_path_factory.mktemp("tiny") / "model"),
                            engines=engines, admin_listener=True)
    fronts: dict[bool, HttpFront] = {}
    try:
        for from_user in (False, True):
            config = ServeConfig(host="127.0.0.1", port=0, keys=KEYS,
                                 http=HttpSettings(port=0, session_from_user=from_user))
            fronts[from_user] = HttpFront(config, Authenticator(KEYS), engines)
            fronts[from_user].start()
        yield Stack(running, fronts)
    finally:
        for front in fronts.values():
            front.stop(timeout_s=5.0)
        running.stop()


@pytest.fixture(autouse=True)
def _fresh(stack: Stack, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No sessions and no blocks from an earlier test; no KVGATE_* keys from the environment."""
    for name in ("KVGATE_API_KEY", "KVGATE_API_KEYS", "KVGATE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    admin = stack.admin()
    for session in admin.list_sessions():
        admin.reset_session(session.session_id, tenant=session.tenant)
    admin.flush()


def _turns(client: KvgateClient, session: str) -> list[dict[str, str]]:
    """Two turns of ``session`` under the warmed system prompt; the third turn's messages."""
    client.warm(messages=SYSTEM, add_generation_prompt=False)
    messages = [*SYSTEM, {"role": "user", "content": "How do refunds work for annual plans?"}]
    for follow_up in ("And for monthly plans?", "Thanks."):
        text, _ = client.generate_text(messages=messages, max_tokens=12, session_id=session)
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": follow_up}]
    return messages


def _system_tokens(client: KvgateClient) -> int:
    return client.lookup(messages=SYSTEM, add_generation_prompt=False).cached_tokens


def _ls(stack: Stack, capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert main(_admin(stack.running, "sessions", "ls", "--json", *args)) == 0
    listed = json.loads(capsys.readouterr().out)
    assert isinstance(listed, list)
    return listed


def test_a_reset_session_starts_cold_and_the_shared_system_prompt_still_hits(
    stack: Stack, capsys: pytest.CaptureFixture[str],
) -> None:
    client = stack.running.client(KEY_A)
    messages = _turns(client, "chat-1")
    system = _system_tokens(client)
    assert client.lookup(messages=messages).cached_tokens > system
    [listed] = _ls(stack, capsys)
    assert (listed["session_id"], listed["tenant"]) == ("chat-1", "tenant-a")
    assert listed["num_blocks"] > 0 and listed["num_bytes"] > 0
    assert 0 < listed["expires_in_s"] <= 1800
    assert main(_admin(stack.running, "sessions", "ls")) == 0
    assert "chat-1" in capsys.readouterr().out

    assert main(_admin(stack.running, "sessions", "reset", "chat-1", "--tenant",
                       "tenant-a")) == 0

    assert "reset session 'chat-1' of tenant-a" in capsys.readouterr().out
    assert client.lookup(messages=messages).cached_tokens == system
    _, usage = client.generate_text(messages=messages, max_tokens=2, session_id="chat-1")
    assert usage.cached_tokens <= system
    assert _system_tokens(client) == system


def test_another_tenants_session_is_not_found_like_one_that_never_was(
    stack: Stack, capsys: pytest.CaptureFixture[str],
) -> None:
    b = stack.running.client(KEY_B)
    b.generate_text(messages=SYSTEM, max_tokens=4, session_id="chat-b")
    answers = []
    for session in ("chat-b", "chat-x"):
        capsys.readouterr()
        assert main(_admin(stack.running, "sessions", "reset", session, "--tenant",
                           "tenant-a")) == 3
        answers.append(capsys.readouterr().err.replace(session, "ID"))
        with pytest.raises(KvgateError) as excinfo:
            stack.admin().reset_session(session, tenant="tenant-a")
        assert excinfo.value.code == grpc.StatusCode.NOT_FOUND
    assert answers[0] == answers[1]
    assert "nothing changed: no session 'ID' of tenant 'tenant-a'" in answers[0]
    assert stack.sessions() == {"chat-b": "tenant-b"}
    assert _ls(stack, capsys, "--tenant", "tenant-a") == []


def test_a_reset_without_a_tenant_finds_the_one_tenant_with_that_session(
    stack: Stack,
) -> None:
    stack.running.client(KEY_B).generate_text(messages=SYSTEM, max_tokens=4,
                                              session_id="chat-b")
    assert stack.admin().reset_session("chat-b").tenant == "tenant-b"
    assert stack.sessions() == {}


def test_a_tenant_key_can_neither_list_nor_reset_sessions(stack: Stack) -> None:
    a = stack.running.client(KEY_A)
    a.generate_text(messages=SYSTEM, max_tokens=4, session_id="chat-a")
    for call in (lambda: a.list_sessions(), lambda: a.reset_session("chat-a")):
        with pytest.raises(KvgateError) as excinfo:
            call()
        assert excinfo.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert stack.sessions() == {"chat-a": "tenant-a"}


@pytest.mark.parametrize(("options", "message"), [
    ({"session_id": "chat 1"}, "cache.session_id: 'chat 1' is not a session id"),
    ({"session_id": "x" * 129}, "is not a session id: use 1 to 128"),
    ({"session_id": "chat-1", "no_cache": True}, "no_cache stores none"),
])
def test_generate_refuses_a_session_it_cannot_keep(stack: Stack, options: dict[str, Any],
                                                   message: str) -> None:
    with pytest.raises(KvgateError) as excinfo:
        stack.running.client(KEY_A).generate_text(messages=SYSTEM, max_tokens=2, **options)
    assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in excinfo.value.details
    assert stack.sessions() == {}


def test_a_session_in_the_shared_scope_is_refused(stack: Stack) -> None:
    with pytest.raises(KvgateError) as excinfo:
        stack.admin().generate_text(messages=SYSTEM, max_tokens=2, shared=True,
                                    session_id="chat-1")
    assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "the shared scope has none" in excinfo.value.details


def test_the_admin_edges_refuse_a_bad_session_id_or_tenant(
    stack: Stack, capsys: pytest.CaptureFixture[str],
) -> None:
    for call in (lambda: stack.admin().reset_session("a b"),
                 lambda: stack.admin().list_sessions(tenant="shared"),
                 lambda: stack.admin().list_sessions(limit=1001)):
        with pytest.raises(KvgateError) as excinfo:
            call()
        assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT
    capsys.readouterr()
    assert main(_admin(stack.running, "sessions", "reset", "a/b")) == 2
    assert "is not a session id" in capsys.readouterr().err


def test_a_reset_that_frees_nothing_here_says_so_and_exits_3(
    stack: Stack, capsys: pytest.CaptureFixture[str],
) -> None:
    a = stack.running.client(KEY_A)
    a.warm(messages=SYSTEM, add_generation_prompt=False)
    a.generate_text(messages=SYSTEM, max_tokens=1, add_generation_prompt=False,
                    session_id="reader")  # reads the warmed blocks, stores only a tail
    a.generate_text(messages=[*SYSTEM, {"role": "user", "content": "Hi"}], max_tokens=1,
                    session_id="other")  # continues that tail: nobody's own any more
    capsys.readouterr()
    assert main(_admin(stack.running, "sessions", "reset", "reader")) == 3
    assert "owned no block or tail on this replica" in capsys.readouterr().err
    assert _system_tokens(a) > 0


def test_the_x_session_id_header_names_the_session_over_http(stack: Stack) -> None:
    status, body = stack.chat("Where is my invoice?", headers={"X-Session-Id": "web-1"})
    assert status == 200, body
    assert stack.sessions() == {"web-1": "tenant-a"}


@pytest.mark.parametrize(("headers", "fields", "param"), [
    ({"X-Session-Id": "web 1"}, {}, "X-Session-Id"),
    ({"X-Session-Id": "web-1"}, {"kvgate": {"no_cache": True}}, "X-Session-Id"),
])
def test_http_refuses_a_session_header_it_cannot_keep(
    stack: Stack, headers: dict[str, str], fields: dict[str, Any], param: str,
) -> None:
    status, body = stack.chat("Where is my invoice?", headers=headers, **fields)
    assert status == 400 and body["error"]["param"] == param, body
    assert stack.sessions() == {}


def test_user_names_the_session_only_where_the_gateway_says_so(stack: Stack) -> None:
    assert stack.chat("Hi", user="user-1")[0] == 200
    assert stack.sessions() == {}  # off by default: `user` is accepted and names nothing
    assert stack.chat("Hi", user="user-2", from_user=True)[0] == 200
    assert stack.chat("Hi", user="user-3", from_user=True,
                      headers={"X-Session-Id": "web-3"})[0] == 200  # the header wins
    assert stack.chat("Hi", user="user-4", from_user=True,
                      kvgate={"no_cache": True})[0] == 200  # no cache: no session
    assert stack.sessions() == {"user-2": "tenant-a", "web-3": "tenant-a"}
    status, body = stack.chat("Hi", user="Jane Doe", from_user=True)
    assert status == 400 and body["error"]["param"] == "user", body
    assert "session_from_user" in body["error"]["message"]
