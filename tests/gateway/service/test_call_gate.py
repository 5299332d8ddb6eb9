"""Auth before resources, over a real channel: calls without a valid key hold nothing, keyed
calls hold at most their key's share, and health checks are answered whatever the calls do.

docs/reliability.md threat 5: 64 calls that sent headers and no body, with no key, once locked keyed
calls and health checks out of kvgate (a global ``maximum_concurrent_rpcs`` counted them before
their key was checked). Header-only streams are opened here with a request iterator that never
yields: the client sends the call's headers and then nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import InvalidArgument, ResourceExhausted
from gateway.config.limits import LimitSettings
from gateway.config.settings import GrpcSettings
from gateway.engine.engine import EngineConfig
from gateway.engine.models.loading import LoadedModel
from gateway.service.pb import kvgate_pb2 as pb
from tests.gateway.grpc_harness import (
    ADMIN_KEY,
    BLOCK,
    KEY_A,
    KEY_B,
    RunningGateway,
    metadata,
    start_gateway,
    tiny_model,
    wait_until,
)

SERVING = health_pb2.HealthCheckResponse.SERVING
SERIAL = EngineConfig(block_tokens=BLOCK, route="serial")
"""What is tested here happens before the engine: the serial route starts without the
invariance probe (seconds of CPU per gateway)."""
LOOKUP = "/kvgate.v1.Gateway/Lookup"
GENERATE = "/kvgate.v1.Gateway/Generate"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


class HeaderOnlyCalls:
    """Calls that send their headers and never a request message, until ``release``."""

    def __init__(self) -> None:
        self._release = threading.Event()
        self.futures: list[Any] = []

    def _never(self) -> Iterator[bytes]:
        self._release.wait()
        return
        yield b""  # a generator that yields nothing

    def open(self, channel: Any, method: str, api_key: str | None, *,
             response_streaming: bool = False) -> None:
        if response_streaming:
            call = channel.stream_stream(method)(self._never(), metadata=metadata(api_key))
            self.futures.append(_StreamFuture(call))
        else:
            self.futures.append(
                channel.stream_unary(method).future(self._never(), metadata=metadata(api_key)))

    def codes(self, timeout_s: float = 10.0) -> list[grpc.StatusCode]:
        """The status each call ended with (waiting up to ``timeout_s`` for each)."""
        codes = []
        for future in self.futures:
            try:
                future.result(timeout=timeout_s)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
        return codes

    def release(self) -> None:
        self._release.set()


class _StreamFuture:
    def __init__(self, call: Any) -> None:
        self._call = call

    def result(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self._call.code() is None and time.monotonic() < end:
            time.sleep(0.01)
        if self._call.code() is None:
            raise TimeoutError("the call did not end")
        if self._call.code() != grpc.StatusCode.OK:
            raise _Ended(self._call.code())


class _Ended(grpc.RpcError):  # type: ignore[misc]  # grpc is untyped
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__()
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def keyed_lookup(gateway: RunningGateway, api_key: str = KEY_A) -> pb.LookupResponse:
    stub = gateway.channel().unary_unary(
        LOOKUP, request_serializer=pb.LookupRequest.SerializeToString,
        response_deserializer=pb.LookupResponse.FromString)
    request = pb.LookupRequest(input=pb.PromptInput(prompt="are keyed calls still served?"))
    return stub(request, metadata=metadata(api_key), timeout=10)


def health_check(gateway: RunningGateway) -> Any:
    stub = health_pb2_grpc.HealthStub(gateway.channel())
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status


@pytest.fixture(scope="module")
def gateway(loaded: LoadedModel) -> Iterator[RunningGateway]:
    running = start_gateway(loaded, engine_config=SERIAL,
                            grpc_settings=GrpcSettings(body_timeout_s=30.0))
    try:
        yield running
    finally:
        running.stop()


def test_header_only_calls_without_a_key_hold_nothing(gateway: RunningGateway) -> None:
    calls = HeaderOnlyCalls()
    channels = [gateway.channel() for _ in range(4)]  # 32 streams per connection at most
    try:
        for i in range(96):
            calls.open(channels[i % 4], GENERATE if i % 2 else LOOKUP, None,
                       response_streaming=bool(i % 2))
        # Their clients still hold the streams open; the server has refused each on its headers.
        assert keyed_lookup(gateway).prompt_tokens > 0
        assert health_check(gateway) == SERVING
        assert calls.codes() == [grpc.StatusCode.UNAUTHENTICATED] * 96
        assert gateway.server.admission.snapshot().calls == 0
    finally:
        calls.release()


def test_header_only_calls_with_a_wrong_key_or_a_tenant_key_on_admin_hold_nothing(
    gateway: RunningGateway,
) -> None:
    calls = HeaderOnlyCalls()
    channel = gateway.channel()
    try:
        for _ in range(8):
            calls.open(channel, LOOKUP, "not-a-key-of-this-gateway-0123")
            calls.open(channel, "/kvgate.v1.Admin/Stats", KEY_A)
        assert keyed_lookup(gateway).prompt_tokens > 0
        assert calls.codes() == [grpc.StatusCode.UNAUTHENTICATED,
                                 grpc.StatusCode.PERMISSION_DENIED] * 8
    finally:
        calls.release()


def test_a_keyed_call_that_never_sends_its_request_is_cancelled_after_the_body_timeout(
    loaded: LoadedModel,
) -> None:
    running = start_gateway(loaded, engine_config=SERIAL,
                            grpc_settings=GrpcSettings(body_timeout_s=0.5))
    calls = HeaderOnlyCalls()
    try:
        calls.open(running.channel(), LOOKUP, KEY_A)
        calls.open(running.channel(), GENERATE, KEY_A, response_streaming=True)
        assert calls.codes() == [grpc.StatusCode.CANCELLED] * 2
        assert wait_until(lambda: running.server.admission.snapshot().calls == 0)
        assert keyed_lookup(running).prompt_tokens > 0
    finally:
        calls.release()
        running.stop()


def test_a_key_that_holds_its_limit_does_not_hold_up_other_keys_or_health(
    loaded: LoadedModel,
) -> None:
    running = start_gateway(
        loaded, engine_config=SERIAL, grpc_settings=GrpcSettings(body_timeout_s=30.0),
        limits=LimitSettings(max_calls=5, max_calls_per_key=2, max_lookups=4,
                             max_lookups_per_key=2))
    held = HeaderOnlyCalls()
    try:
        for api_key in (KEY_A, KEY_A, KEY_B, KEY_B):
            held.open(running.channel(), GENERATE, api_key, response_streaming=True)
        assert wait_until(lambda: running.server.admission.snapshot().calls == 4)
        with pytest.raises(grpc.RpcError) as per_key:
            keyed_lookup(running, KEY_A)
        assert per_key.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_calls_per_key" in per_key.value.details()
        assert keyed_lookup(running, ADMIN_KEY).prompt_tokens > 0  # the fifth slot
        assert health_check(running) == SERVING
        held.release()  # they end without a request message
        assert held.codes() == [grpc.StatusCode.INVALID_ARGUMENT] * 4
        assert wait_until(lambda: running.server.admission.snapshot().calls == 0)
        assert keyed_lookup(running, KEY_A).prompt_tokens > 0
    finally:
        held.release()
        running.stop()


def test_header_only_health_checks_over_their_threads_are_refused_not_queued(
    loaded: LoadedModel,
) -> None:
    running = start_gateway(loaded, engine_config=SERIAL,
                            grpc_settings=GrpcSettings(body_timeout_s=30.0, health_threads=2))
    held = HeaderOnlyCalls()
    try:
        held.open(running.channel(), HEALTH_CHECK, None)
        held.open(running.channel(), HEALTH_CHECK, None)
        # Both wait for their bodies on the two health threads: a third is refused at once.
        assert wait_until(lambda: _health_code(running) == grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert keyed_lookup(running).prompt_tokens > 0  # keyed calls do not share them
        held.release()
        assert held.codes() == [grpc.StatusCode.INVALID_ARGUMENT] * 2
        assert wait_until(lambda: _health_code(running) == grpc.StatusCode.OK)
    finally:
        held.release()
        running.stop()


def _health_code(running: RunningGateway) -> grpc.StatusCode:
    try:
        assert health_check(running) == SERVING
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# ---- limits before work ---------------------------------------------------------------------


def test_lookups_cannot_take_every_worker_thread(loaded: LoadedModel) -> None:
    running = start_gateway(
        loaded, engine_config=SERIAL, grpc_settings=GrpcSettings(body_timeout_s=30.0),
        limits=LimitSettings(max_calls=6, max_calls_per_key=3, max_lookups=2,
                             max_lookups_per_key=1))
    held = HeaderOnlyCalls()
    try:
        held.open(running.channel(), LOOKUP, KEY_A)
        held.open(running.channel(), LOOKUP, KEY_B)
        assert wait_until(lambda: running.server.admission.snapshot().lookups == 2)
        with pytest.raises(grpc.RpcError) as per_key:
            keyed_lookup(running, KEY_A)
        assert "max_lookups_per_key" in per_key.value.details()
        with pytest.raises(grpc.RpcError) as in_total:
            keyed_lookup(running, ADMIN_KEY)
        assert in_total.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(limits.max_lookups)" in in_total.value.details()
        # The other threads still serve everything else.
        text, usage = running.client(ADMIN_KEY).generate_text("still served?", max_tokens=2)
        assert usage.completion_tokens >= 1
    finally:
        held.release()
        running.stop()


def test_oversized_prompts_are_refused_before_any_work(loaded: LoadedModel) -> None:
    running = start_gateway(loaded, engine_config=SERIAL,
                            limits=LimitSettings(max_prompt_chars=2000, max_messages=4))
    try:
        client = running.client(KEY_A)
        with pytest.raises(InvalidArgument, match="limits.max_prompt_chars"):
            client.generate_text("x" * 2001, max_tokens=1)
        with pytest.raises(InvalidArgument, match="limits.max_prompt_chars"):
            client.lookup("x" * 2001)
        with pytest.raises(InvalidArgument, match="limits.max_messages"):
            client.warm(messages=[{"role": "user", "content": "hi"}] * 5)
        assert running.client(KEY_A).lookup("x" * 2000).prompt_tokens > 0
    finally:
        running.stop()


def test_the_lookup_rate_is_limited_per_key(loaded: LoadedModel) -> None:
    running = start_gateway(loaded, engine_config=SERIAL,
                            limits=LimitSettings(lookups_per_s=0.01, lookup_burst=2))
    try:
        tenant_a = running.client(KEY_A)
        tenant_a.lookup("one")
        tenant_a.lookup("two")
        with pytest.raises(ResourceExhausted, match="limits.lookups_per_s"):
            tenant_a.lookup("three")
        running.client(KEY_B).lookup("one")  # B has a bucket of its own
    finally:
        running.stop()
