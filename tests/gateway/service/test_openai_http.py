"""The OpenAI-compatible HTTP front through the real ``openai`` SDK, beside the real gRPC service.

One real gateway per module, as ``kvgate serve`` builds it: the tiny Llama, a real cache and
engine with metrics, the gRPC server and the HTTP front sharing one ``EngineSlot``, one
``Authenticator`` and one ``PromptComparisons``, each on a free loopback port. Requests go
through ``openai.OpenAI`` (retries off, so every error is seen as sent); what the SDK cannot
send (no key, a body that is not JSON, a chunked body, a dropped connection) goes through
``http.client`` or a raw socket.

The engine allows one running and one queued request per tenant, so that a full queue (429) can
be made on purpose; tenant B is used only by that test.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.config.limits import LimitSettings
from gateway.config.settings import HttpSettings, ServeConfig
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import LoadedModel
from gateway.service.admission import Admission, CallKind
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.server import HttpFront
from gateway.service.metrics import GatewayMetrics
from gateway.service.prompt_comparisons import PromptComparisons
from gateway.service.server import ServeError
from tests.gateway.grpc_harness import (
    ADMIN_KEY,
    BLOCK,
    KEY_A,
    KEY_B,
    KEYS,
    LONG_PROMPT,
    RunningGateway,
    start_gateway,
    tiny_model,
    wait_until,
)

MAX_BODY = 64 << 10
MODEL = "model"
"""The served model's id: the checkpoint directory's name (``tiny_model`` saves to .../model)."""
LONG_STREAM = 1800
"""max_tokens of a stream that is still running when a test acts on it (context 2,048)."""


class Stack:
    """The module's gateway: gRPC and HTTP over one engine, cache and metrics."""

    def __init__(self, running: RunningGateway, front: HttpFront, metrics: GatewayMetrics,
                 engines: EngineSlot):
        self.running = running
        self.engines = engines
        self.front = front
        self.metrics = metrics
        self._clients: dict[str, openai.OpenAI] = {}

    @property
    def url(self) -> str:
        return self.front.url

    def sdk(self, api_key: str = KEY_A) -> Any:
        """An SDK client with this key (one per key, closed with the module's server).

        Typed ``Any``: the SDK's overloads are written for OpenAI's models and fields, and these
        tests send kvgate's and wrong ones on purpose."""
        if api_key not in self._clients:
            self._clients[api_key] = openai.OpenAI(base_url=self.url, api_key=api_key,
                                                   max_retries=0, timeout=60.0)
        return self._clients[api_key]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self.front.stop(timeout_s=5.0)
        self.running.stop()

    def raw(self, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.front.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return (response.status, {k.lower(): v for k, v in response.getheaders()},
                    response.read())
        finally:
            conn.close()

    @property
    def engine(self) -> Engine:
        assert self.running.engine is not None
        return self.running.engine

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("tiny") / MODEL)


@pytest.fixture(scope="module")
def stack(loaded: LoadedModel) -> Iterator[Stack]:
    engines = EngineSlot()
    metrics = GatewayMetrics()
    comparisons = PromptComparisons(block_tokens=BLOCK)  # one for both, as `kvgate serve`'s
    running = start_gateway(
        loaded, engines=engines, metrics=metrics, comparisons=comparisons,
        engine_config=EngineConfig(block_tokens=BLOCK, max_running_per_tenant=1,
                                   max_queued_per_tenant=1))
    config = ServeConfig(host="127.0.0.1", port=0, keys=KEYS,
                         http=HttpSettings(port=0, max_body_bytes=MAX_BODY))
    front = HttpFront(config, Authenticator(KEYS), engines, comparisons=comparisons)
    front.start()
    stack = Stack(running, front, metrics, engines)
    try:
        yield stack
    finally:
        stack.close()


def unique(text: str) -> str:
    """``text`` behind a random first line, so that no other test has cached it."""
    return f"[{random.randrange(10**12)}] {text}"


def chat(stack: Stack, content: str, **options: Any) -> Any:
    return stack.sdk().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **options)


def assert_healthy(stack: Stack) -> None:
    """Serving, no blocks held, and a good request is answered."""
    status, _, body = stack.raw("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert wait_until(lambda: stack.running.total_refcount() == 0, timeout_s=10.0)
    assert chat(stack, "still serving?", max_tokens=2).usage.completion_tokens >= 1


# ---- models, health --------------------------------------------------------------------


def test_models_lists_the_served_model_and_retrieves_it(stack: Stack) -> None:
    client = stack.sdk()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "kvgate"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_health_needs_no_key_and_says_ok_once_the_engine_is_attached(stack: Stack) -> None:
    status, _, body = stack.raw("GET", "/health")
    assert status == 200
    assert json.loads(body) == {"status": "ok", "model": MODEL}


# ---- answers ---------------------------------------------------------------------------


def test_a_chat_answer_has_openai_usage_and_the_kvgate_object(stack: Stack) -> None:
    completion = chat(stack, unique(LONG_PROMPT), max_tokens=6)
    assert completion.object == "chat.completion" and completion.model == MODEL
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.completion_tokens <= 6
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    kvgate = usage.kvgate
    assert kvgate["cached_tokens_by_tier"] == {}
    assert kvgate["ttft_ms"] > 0 and kvgate["total_ms"] >= kvgate["ttft_ms"]


def test_a_repeated_prompt_is_served_from_cache_with_the_same_text_as_grpc_and_no_cache(
    stack: Stack,
) -> None:
    prompt = unique(LONG_PROMPT)
    cold = chat(stack, prompt, max_tokens=8)
    warm = chat(stack, prompt, max_tokens=8)
    uncached = chat(stack, prompt, max_tokens=8, extra_body={"kvgate": {"no_cache": True}})
    text, grpc_usage = stack.running.client(KEY_A).generate_text(
        messages=[{"role": "user", "content": prompt}], max_tokens=8)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert warm.usage.kvgate["cached_tokens_by_tier"] == {
        "device": warm.usage.prompt_tokens_details.cached_tokens}
    assert uncached.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert uncached.choices[0].message.content == cold.choices[0].message.content
    assert text == cold.choices[0].message.content
    assert grpc_usage.prompt_tokens == cold.usage.prompt_tokens


def test_a_stream_sends_role_then_text_then_finish_and_usage_when_asked(stack: Stack) -> None:
    prompt = unique(LONG_PROMPT)
    whole = chat(stack, prompt, max_tokens=8)
    chunks = list(chat(stack, prompt, max_tokens=8, stream=True,
                       stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_a_stream_without_include_usage_carries_no_usage(stack: Stack) -> None:
    chunks = list(chat(stack, unique("hi"), max_tokens=3, stream=True))
    assert all(c.choices and c.usage is None for c in chunks)


def test_a_prefix_warmed_over_grpc_is_a_hit_over_http(stack: Stack) -> None:
    messages = [{"role": "system", "content": unique(LONG_PROMPT)},
                {"role": "user", "content": "And the answer?"}]
    warmed = stack.running.client(KEY_A).warm(messages=messages[:1])
    assert warmed.num_new_blocks > 0
    completion = stack.sdk().chat.completions.create(model=MODEL, messages=messages,
                                                     max_tokens=2)
    cached = completion.usage.prompt_tokens_details.cached_tokens
    assert cached >= warmed.num_blocks * BLOCK > 0
    assert completion.usage.kvgate["cached_tokens_by_tier"] == {"device": cached}


def test_tools_text_parts_and_tool_messages_are_the_same_prompt_as_over_grpc(
    stack: Stack,
) -> None:
    tool = {"type": "function", "function": {
        "name": "refund", "description": "Refund an order.",
        "parameters": {"type": "object", "properties": {"order": {"type": "string"}}}}}
    system = unique(LONG_PROMPT)
    http_messages: list[Any] = [
        {"role": "developer", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": "Refund order 7."},
        {"role": "assistant", "content": "Calling refund."},
        {"role": "tool", "tool_call_id": "call_1", "content": "refunded"},
    ]
    grpc_messages = [{"role": "system", "content": system},
                     {"role": "user", "content": "Refund order 7."},
                     {"role": "assistant", "content": "Calling refund."},
                     {"role": "tool", "content": "refunded"}]
    completion = stack.sdk().chat.completions.create(
        model=MODEL, messages=http_messages, tools=[tool], tool_choice="auto", max_tokens=2)
    lookup = stack.running.client(KEY_A).lookup(messages=grpc_messages, tools=[tool])
    assert lookup.prompt_tokens == completion.usage.prompt_tokens
    assert lookup.cached_tokens == completion.usage.prompt_tokens // BLOCK * BLOCK > 0


def test_a_completion_answers_raw_text_like_grpc_and_streams_the_same(stack: Stack) -> None:
    prompt = unique(LONG_PROMPT)
    client = stack.sdk()
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
    assert completion.object == "text_completion"
    text, usage = stack.running.client(KEY_A).generate_text(prompt, max_tokens=5)
    assert completion.choices[0].text == text
    assert completion.usage.prompt_tokens == usage.prompt_tokens
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == completion.choices[0].finish_reason


def test_allow_lossy_without_a_lossy_tier_is_answered_exactly_and_every_usage_says_exact(
    stack: Stack,
) -> None:
    """No tier of this gateway keeps lossy copies: chats and completions that allow them,
    whole or streamed, get the exact answer, and their usage's kvgate object says so."""
    prompt = unique(LONG_PROMPT)
    lossy_ok = {"kvgate": {"allow_lossy": True}}
    exact = chat(stack, prompt, max_tokens=6)
    allowed = chat(stack, prompt, max_tokens=6, extra_body=lossy_ok)
    streamed = list(chat(stack, prompt, max_tokens=6, stream=True, extra_body=lossy_ok,
                         stream_options={"include_usage": True}))
    completion = stack.sdk().completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                                 extra_body=lossy_ok)
    assert allowed.choices[0].message.content == exact.choices[0].message.content
    assert allowed.usage.kvgate["cached_tokens_by_tier"] == {
        "device": allowed.usage.prompt_tokens_details.cached_tokens}
    for usage in (exact.usage, allowed.usage, streamed[-1].usage, completion.usage):
        assert usage.kvgate["exact"] is True


def test_http_requests_are_counted_in_the_gateways_metrics(stack: Stack) -> None:
    def counts() -> tuple[float, float]:
        return (stack.count("kvgate_prompt_tokens_total", tenant="tenant-a", source="computed",
                            tier="none"),
                stack.count("kvgate_prompt_tokens_total", tenant="tenant-a", source="cache",
                            tier="device"))

    computed, cached = counts()
    usage = chat(stack, unique("count me"), max_tokens=2).usage
    hits = usage.prompt_tokens_details.cached_tokens
    assert counts() == (computed + usage.prompt_tokens - hits, cached + hits)


# ---- errors ----------------------------------------------------------------------------


def test_a_missing_or_unknown_key_is_401_in_openai_shape(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as excinfo:
        stack.sdk("not-a-key-0123456789abcdef").models.list()
    assert excinfo.value.code == "unauthenticated"
    status, _, body = stack.raw("POST", "/v1/chat/completions", b"{}")
    error = json.loads(body)["error"]
    assert status == 401 and error["type"] == "authentication_error"
    assert "Bearer" in error["message"]
    # HTTP speaks of headers, never of gRPC metadata.
    assert "HTTP header `Authorization: Bearer <key>`" in error["message"]
    status, _, body = stack.raw("POST", "/v1/chat/completions", b"{}",
                                headers={"Authorization": "Basic abc"})
    message = json.loads(body)["error"]["message"]
    assert status == 401 and "`authorization` header must be `Bearer <key>`" in message
    assert "metadata" not in error["message"] + message


def test_the_shared_scope_with_a_tenant_key_is_403(stack: Stack) -> None:
    with pytest.raises(openai.PermissionDeniedError):
        chat(stack, "hi", max_tokens=1, extra_body={"kvgate": {"scope": "shared"}})
    admin = stack.sdk(ADMIN_KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"kvgate": {"scope": "shared"}})
    assert admin.usage.completion_tokens == 1


@pytest.mark.parametrize(("options", "param"), [
    ({"n": 2}, "n"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.invalid/x.png"}}]}]},
     "messages[0].content[0]"),
    ({"extra_body": {"audio": {"voice": "alloy", "format": "wav"}}}, "audio"),
    ({"extra_body": {"mystery": 1}}, "mystery"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logprobs": True}, "logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"temperature": 11}, "temperature"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages[0].name"),
    ({"extra_body": {"kvgate": {"ttl_s": -1}}}, "kvgate.ttl_s"),
    ({"extra_body": {"priority": 1_001}}, "priority"),
    ({"extra_body": {"priority": "high"}}, "priority"),
    ({"extra_body": {"kvgate": {"pin": True}}}, "kvgate"),
    ({"extra_body": {"kvgate": {"allow_lossy": "yes"}}}, "kvgate.allow_lossy"),
])
def test_unsupported_or_invalid_fields_are_400_naming_the_field(
    stack: Stack, options: dict[str, Any], param: str,
) -> None:
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 1,
                               "messages": [{"role": "user", "content": "hi"}], **options}
    with pytest.raises(openai.BadRequestError) as excinfo:
        stack.sdk().chat.completions.create(**request)
    assert excinfo.value.param == param
    assert excinfo.value.code == "invalid_argument"


def test_a_body_that_is_not_one_json_object_is_400(stack: Stack) -> None:
    auth = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    for body in (b"{not json", b"[1, 2]", b'{"model": NaN}', b"[" * 50_000):
        status, _, answer = stack.raw("POST", "/v1/chat/completions", body, auth)
        assert status == 400, body[:20]
        assert json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert_healthy(stack)


def test_an_unknown_model_or_path_is_404(stack: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as excinfo:
        stack.sdk().chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert excinfo.value.code == "model_not_found" and MODEL in excinfo.value.message
    status, _, body = stack.raw("GET", "/v1/engines", headers={"Authorization": f"Bearer {KEY_A}"})
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"


def test_a_body_over_the_limit_is_413_before_it_is_parsed(stack: Stack) -> None:
    with pytest.raises(openai.APIStatusError) as excinfo:
        chat(stack, "x" * (MAX_BODY + 1), max_tokens=1)
    assert excinfo.value.status_code == 413
    assert excinfo.value.code == "request_too_large"
    # chunked: no Content-Length to check, so the limit holds as the body arrives
    body = b"x" * (MAX_BODY + 1)
    with socket.create_connection(("127.0.0.1", stack.front.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + KEY_A.encode() + b"\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n"
                     b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        assert sock.recv(64).startswith(b"HTTP/1.1 413 ")
    assert_healthy(stack)


def test_a_full_queue_is_429_with_retry_after_and_the_queue_drains(stack: Stack) -> None:
    client = stack.sdk(KEY_B)
    running = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=LONG_STREAM, stream=True)
    next(iter(running))  # tenant B's one running request is decoding
    queued: list[Any] = []
    waiter = threading.Thread(target=lambda: queued.append(client.completions.create(
        model=MODEL, prompt="queued", max_tokens=1)))
    waiter.start()
    try:
        assert wait_until(lambda: stack.count("kvgate_queue_depth") >= 1)
        with pytest.raises(openai.RateLimitError) as excinfo:
            client.completions.create(model=MODEL, prompt="one too many", max_tokens=1)
        assert excinfo.value.response.headers["retry-after"] == "1"
        assert "max_queued_per_tenant" in excinfo.value.message
    finally:
        running.close()
        waiter.join(timeout=60)
    assert queued and queued[0].usage.completion_tokens == 1
    assert_healthy(stack)


def test_a_deadline_before_the_first_token_is_504(stack: Stack) -> None:
    with pytest.raises(openai.InternalServerError) as excinfo:
        chat(stack, unique(LONG_PROMPT), max_tokens=4,
             extra_body={"kvgate": {"timeout_s": 1e-6}})
    assert excinfo.value.status_code == 504
    assert excinfo.value.code == "deadline_exceeded"


def test_a_deadline_mid_stream_ends_it_with_an_error_event(stack: Stack) -> None:
    # The deadline must fall between the first token and the end of the stream, and how long a
    # whole stream takes depends on the machine and on what else runs on it (a quiet CI machine
    # ran all ~1,000 tokens that fit the context in under a second; another stream may stop
    # early at an end-of-text token): time one here, then give the next ones half, a quarter
    # and an eighth of that until a deadline falls mid-stream. A stream that ends without an
    # error must have ended before its deadline.
    started = time.perf_counter()
    first_token_s = None
    for _ in chat(stack, unique(LONG_PROMPT), max_tokens=LONG_STREAM, stream=True):
        if first_token_s is None:
            first_token_s = time.perf_counter() - started
    whole_s = time.perf_counter() - started
    assert first_token_s is not None and first_token_s < whole_s / 4, (first_token_s, whole_s)
    message = None
    for fraction in (0.5, 0.25, 0.125):
        timeout_s = whole_s * fraction
        started = time.perf_counter()
        try:
            for _ in chat(stack, unique(LONG_PROMPT), max_tokens=LONG_STREAM, stream=True,
                          extra_body={"kvgate": {"timeout_s": timeout_s}}):
                pass
        except openai.APIError as exc:
            message = exc.message
            break
        assert time.perf_counter() - started < timeout_s + 0.5, "ran past its deadline"
    assert message is not None and "deadline" in message, message
    assert_healthy(stack)


def test_a_server_still_loading_its_model_answers_503_with_retry_after() -> None:
    config = ServeConfig(host="127.0.0.1", port=0, keys=KEYS, http=HttpSettings(port=0))
    front = HttpFront(config, Authenticator(KEYS), EngineSlot())
    front.start()
    try:
        with openai.OpenAI(base_url=front.url, api_key=KEY_A, max_retries=0) as client, \
                pytest.raises(openai.InternalServerError) as excinfo:
            client.chat.completions.create(model=MODEL,
                                           messages=[{"role": "user", "content": "hi"}])
        assert excinfo.value.status_code == 503
        assert excinfo.value.response.headers["retry-after"] == "1"
        connection = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
        connection.request("GET", "/health")
        response = connection.getresponse()
        assert response.status == 503 and json.loads(response.read())["status"] == "loading"
        connection.close()
    finally:
        front.stop(timeout_s=5.0)


# ---- disconnects -------------------------------------------------------------------------


def test_a_client_that_drops_a_stream_cancels_it_and_frees_its_blocks(stack: Stack) -> None:
    cancelled = stack.count("kvgate_requests_total", finish_reason="cancelled")
    decoded = stack.engine.counters.num_decode_tokens
    stream = chat(stack, unique(LONG_PROMPT), max_tokens=LONG_STREAM, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    assert wait_until(
        lambda: stack.count("kvgate_requests_total", finish_reason="cancelled") == cancelled + 1,
        timeout_s=30.0)
    assert stack.engine.counters.num_decode_tokens - decoded < LONG_STREAM
    assert_healthy(stack)


def test_a_client_that_drops_before_a_whole_answer_cancels_it(stack: Stack) -> None:
    cancelled = stack.count("kvgate_requests_total", finish_reason="cancelled")
    decoded = stack.engine.counters.num_decode_tokens
    body = json.dumps({"model": MODEL, "max_tokens": LONG_STREAM,
                       "messages": [{"role": "user", "content": unique(LONG_PROMPT)}]}).encode()
    with socket.create_connection(("127.0.0.1", stack.front.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + KEY_A.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(  # it is decoding: the answer is on its way
            lambda: stack.engine.counters.num_decode_tokens > decoded, timeout_s=30.0)
    assert wait_until(
        lambda: stack.count("kvgate_requests_total", finish_reason="cancelled") == cancelled + 1,
        timeout_s=30.0)
    assert_healthy(stack)


def test_a_plaintext_listener_off_loopback_is_refused_like_grpcs() -> None:
    config = ServeConfig(host="127.0.0.1", port=0, keys=KEYS,
                         http=HttpSettings(host="0.0.0.0", port=0))
    with pytest.raises(ServeError, match="without TLS"):
        HttpFront(config, Authenticator(KEYS), EngineSlot()).start()


def test_a_key_over_its_call_limit_gets_429_naming_the_limit_as_over_grpc(stack: Stack) -> None:
    limits = LimitSettings(max_calls_per_key=1)
    admission = Admission(limits)
    config = ServeConfig(host="127.0.0.1", port=0, keys=KEYS, http=HttpSettings(port=0),
                         limits=limits)
    front = HttpFront(config, Authenticator(KEYS), stack.engines, admission)
    front.start()
    principal = Authenticator(KEYS).authenticate([("authorization", f"Bearer {KEY_A}")])
    try:
        with openai.OpenAI(base_url=front.url, api_key=KEY_A, max_retries=0) as client:
            with admission.admit(principal, CallKind.GENERATE), \
                    pytest.raises(openai.RateLimitError) as excinfo:
                client.chat.completions.create(model=MODEL, max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
            assert "max_calls_per_key" in excinfo.value.message
            answer = client.chat.completions.create(
                model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert answer.choices[0].message.content is not None
    finally:
        front.stop(timeout_s=5.0)
