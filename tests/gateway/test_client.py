"""``gateway.client``: typed results, status codes as exceptions, bounded retries of UNAVAILABLE.

Against a real gateway on a loopback port (``tests.gateway.grpc_harness``); a gateway
"still loading its model" is a real server whose engine is attached later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from gateway.client import (
    DeadlineExceeded,
    InvalidArgument,
    KvgateClient,
    KvgateError,
    RetryPolicy,
    Unauthenticated,
    Unavailable,
)
from gateway.core.requests import GenerateRequest, TokenDelta, Usage
from gateway.engine.models.loading import LoadedModel
from gateway.engine.scheduling.jobs import RequestHandle
from tests.gateway.grpc_harness import (
    KEY_A,
    LONG_PROMPT,
    RunningGateway,
    attach_engine,
    start_gateway,
    tiny_model,
)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def gateway(loaded: LoadedModel) -> Iterator[RunningGateway]:
    running = start_gateway(loaded)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def loading() -> Iterator[RunningGateway]:
    """A gateway whose model is still loading (no engine yet)."""
    running = start_gateway(None)
    try:
        yield running
    finally:
        running.stop()


def test_a_key_is_never_sent_in_the_clear_to_a_remote_host() -> None:
    with pytest.raises(ValueError, match="in the clear"):
        KvgateClient("10.1.2.3", 50051, "some-key-0123456789abc")
    KvgateClient("10.1.2.3", 50051, "some-key-0123456789abc", tls=True).close()
    KvgateClient("10.1.2.3", 50051, "some-key-0123456789abc", allow_insecure=True).close()
    KvgateClient("10.1.2.3", 50051, None).close()
    KvgateClient("::1", 50051, "some-key-0123456789abc").close()


def test_backoff_doubles_within_bounds() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.3)
    for attempt, ceiling in ((1, 0.1), (2, 0.2), (3, 0.3), (9, 0.3)):
        for _ in range(20):
            assert ceiling / 2 <= policy.backoff_s(attempt) <= ceiling


def test_generate_streams_deltas_then_usage(gateway: RunningGateway) -> None:
    with KvgateClient("127.0.0.1", gateway.port, KEY_A) as client:
        items = list(client.generate(LONG_PROMPT, max_tokens=5))
        assert all(isinstance(item, TokenDelta) for item in items[:-1])
        usage = items[-1]
        assert isinstance(usage, Usage)
        assert usage.completion_tokens == 5 and usage.finish_reason == "length"
        assert usage.prompt_tokens > 0 and usage.ttft_ms > 0 and usage.total_ms >= usage.ttft_ms
        text, again = client.generate_text(LONG_PROMPT, max_tokens=5)
        assert text == "".join(i.text for i in items[:-1] if isinstance(i, TokenDelta))
        assert again.cached_tokens > 0
        chat, _ = client.generate_text(messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, temperature=0.7, seed=3)
        assert isinstance(chat, str)


def test_allow_lossy_is_sent_as_the_cache_option_the_engine_receives(
    gateway: RunningGateway, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The keyword crosses the wire into the engine's request record (the real engine, whose
    ``generate`` is only listened to); left out, it is false."""
    engine = gateway.engine
    assert engine is not None
    received: list[GenerateRequest] = []
    real_generate = engine.generate

    def listened(request: GenerateRequest) -> RequestHandle:
        received.append(request)
        return real_generate(request)

    monkeypatch.setattr(engine, "generate", listened)
    client = gateway.client(KEY_A)
    client.generate_text("hello there", max_tokens=2)
    _, usage = client.generate_text("hello there", max_tokens=2, allow_lossy=True)
    assert [r.cache.allow_lossy for r in received] == [False, True]
    assert usage.lossy is False  # no tier of this gateway keeps lossy copies


def test_errors_carry_the_status_code_and_the_servers_message(gateway: RunningGateway) -> None:
    client = gateway.client(None)
    with pytest.raises(Unauthenticated) as excinfo:
        client.lookup("hello")
    assert isinstance(excinfo.value, KvgateError)
    assert excinfo.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer" in excinfo.value.details
    assert str(excinfo.value).startswith("UNAUTHENTICATED: ")


def test_other_codes_are_not_retried(gateway: RunningGateway) -> None:
    client = gateway.client(KEY_A, retry=RetryPolicy(max_attempts=5, initial_backoff_s=2.0))
    began = time.monotonic()
    with pytest.raises(InvalidArgument):
        client.generate_text("hello", max_tokens=0)
    assert time.monotonic() - began < 0.9  # one retry would have slept at least 1 s


def test_unavailable_is_retried_until_the_model_has_loaded(
    loading: RunningGateway, loaded: LoadedModel
) -> None:
    client = loading.client(KEY_A, retry=RetryPolicy(max_attempts=50, initial_backoff_s=0.05,
                                                     max_backoff_s=0.1))
    timer = threading.Timer(0.4, attach_engine, args=(loading, loaded))
    timer.start()
    try:
        text, usage = client.generate_text("hello there", max_tokens=3)
    finally:
        timer.join()
    assert usage.completion_tokens == 3


def test_retries_are_bounded(loading: RunningGateway) -> None:
    client = loading.client(KEY_A, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.1,
                                                     max_backoff_s=0.1))
    began = time.monotonic()
    with pytest.raises(Unavailable, match="still loading"):
        client.lookup("hello")
    assert 0.1 <= time.monotonic() - began < 3.0  # two pauses of 0.05..0.1 s


def test_retries_stop_at_the_deadline(loading: RunningGateway) -> None:
    client = loading.client(KEY_A, retry=RetryPolicy(max_attempts=100, initial_backoff_s=0.05,
                                                     max_backoff_s=0.05))
    began = time.monotonic()
    with pytest.raises(Unavailable):
        client.warm("hello", timeout_s=0.5)
    assert time.monotonic() - began < 1.5


def test_nobody_listening_is_unavailable() -> None:
    with KvgateClient("127.0.0.1", 1, KEY_A, retry=RetryPolicy(max_attempts=2),
                      timeout_s=5.0) as client, pytest.raises(Unavailable):
        client.generate_text("hello", max_tokens=1)


def test_a_deadline_is_deadline_exceeded(gateway: RunningGateway) -> None:
    client = gateway.client(KEY_A)
    with pytest.raises(DeadlineExceeded):
        client.generate_text(LONG_PROMPT + " and more", max_tokens=1900, timeout_s=0.3)
