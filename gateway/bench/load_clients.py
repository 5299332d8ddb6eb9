"""The users of ``kvgate bench load`` (and of the benchmarks built on it: ``bench cluster``,
``bench metrics``): threads of the bench process, each with a connection of its own to the
server under test -- kvgate's gRPC API, or any OpenAI-compatible HTTP server (transformers
serve, vLLM, a router in front of kvgate) -- chatting rounds of one conversation in turn.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from gateway.bench.chat_workload import Conversation
from gateway.bench.peer_serve import StreamedReply, Unanswered, stream_chat
from gateway.bench.rows import BenchError
from gateway.client import KvgateClient
from gateway.core.requests import TokenDelta, Usage


class ChatSession(Protocol):
    """One user's connection to the server under test."""

    def chat(self, messages: Sequence[dict[str, str]]) -> StreamedReply: ...

    def close(self) -> None: ...


class KvgateSession:
    """A user's own gRPC channel to a spawned kvgate."""

    def __init__(self, host: str, port: int, api_key: str | None, *, max_tokens: int,
                 no_cache: bool, timeout_s: float) -> None:
        self._client = KvgateClient(host, port, api_key, timeout_s=timeout_s)
        self._max_tokens = max_tokens
        self._no_cache = no_cache

    def chat(self, messages: Sequence[dict[str, str]]) -> StreamedReply:
        began = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        usage: Usage | None = None
        for item in self._client.generate(messages=messages, max_tokens=self._max_tokens,
                                          temperature=0.0, no_cache=self._no_cache):
            if isinstance(item, TokenDelta):
                if first is None:
                    first = time.perf_counter() - began
                parts.append(item.text)
            else:
                usage = item
        latency = time.perf_counter() - began
        if usage is None or first is None:
            raise BenchError("kvgate's stream ended without a token or without usage")
        return StreamedReply(text="".join(parts), ttft_s=first, latency_s=latency,
                             prompt_tokens=usage.prompt_tokens,
                             cached_tokens=usage.cached_tokens,
                             completion_tokens=usage.completion_tokens)

    def close(self) -> None:
        self._client.close()


class HttpSession:
    """A user's own keep-alive HTTP connection to an OpenAI-compatible server
    (``transformers serve``, or a router in front of kvgate with the tenant's ``api_key``).

    ``extra_body``: fields of the server's own sent with each request (vLLM's ``ignore_eos``).
    ``resend_within_s`` > 0: a request no model saw (``Unanswered``: a restarting router refuses
    connections, closes the kept-alive ones it had, routes nothing until its workers register)
    is sent again on a new connection, every 0.1 s for up to that long; ``num_resent`` counts
    the requests sent more than once (not the attempts).
    """

    def __init__(self, host: str, port: int, *, max_tokens: int, timeout_s: float,
                 api_key: str | None = None, server: str = "transformers serve",
                 model: str | None = None, resend_within_s: float = 0.0,
                 extra_body: Mapping[str, Any] | None = None) -> None:
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        self._extra_body = dict(extra_body or {})
        self._max_tokens = max_tokens
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._server = server
        self._model = model
        self._resend_within_s = resend_within_s
        self.num_resent = 0

    def chat(self, messages: Sequence[dict[str, str]]) -> StreamedReply:
        deadline = time.monotonic() + self._resend_within_s
        resent = False
        while True:
            try:
                return stream_chat(self._conn, messages, max_tokens=self._max_tokens,
                                   headers=self._headers, server=self._server,
                                   model=self._model, extra_body=self._extra_body)
            except Unanswered:
                self._conn.close()  # the next request connects anew
                if time.monotonic() >= deadline:
                    raise
                if not resent:
                    self.num_resent += 1
                    resent = True
                time.sleep(0.1)

    def close(self) -> None:
        self._conn.close()


def run_users(open_session: Callable[[], ChatSession], *, num_users: int, rounds: int,
              system: str | Callable[[int], str],
              num_rules: int) -> tuple[list[StreamedReply], float]:
    """``num_users`` threads, released together, each chatting ``rounds`` rounds in turn
    under ``system`` (the same prompt for all, or each user's: ``system(user)``); each reply
    says its user and round.

    Returns:
        Every reply, and the wall time from the release to the last answer.

    Raises:
        BenchError: a user's request failed (the first failure, with the user it hit).
    """
    sessions = [open_session() for _ in range(num_users)]
    start = threading.Barrier(num_users + 1)
    lock = threading.Lock()
    replies: list[StreamedReply] = []
    failures: list[BaseException] = []

    def user(index: int) -> None:
        text = system(index) if callable(system) else system
        conversation = Conversation(user=index, system=text, num_rules=num_rules)
        start.wait()
        try:
            for round_index in range(rounds):
                reply = sessions[index].chat(conversation.next_messages())
                conversation.answered(reply.text)
                with lock:
                    replies.append(replace(reply, user=index, round_index=round_index))
        except Exception as exc:  # noqa: BLE001 -- re-raised below, in the caller's thread
            with lock:
                failures.append(exc)

    threads = [threading.Thread(target=user, args=(i,), name=f"load-user-{i}", daemon=True)
               for i in range(num_users)]
    try:
        for thread in threads:
            thread.start()
        start.wait()
        began = time.perf_counter()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
    finally:
        for session in sessions:
            session.close()
    if failures:
        raise BenchError(f"a user's request failed: {failures[0]}") from failures[0]
    return replies, wall
