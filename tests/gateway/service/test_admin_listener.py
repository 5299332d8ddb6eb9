"""The Admin service on a listener of its own (``[server] admin_port``), over real channels: a
network policy can then let the apps reach the Gateway port and only operators the Admin one."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.client import KvgateClient, RetryPolicy
from gateway.config.settings import ServeConfig
from gateway.engine.engine import EngineConfig
from gateway.engine.models.loading import LoadedModel
from gateway.service.auth import Authenticator
from gateway.service.pb import kvgate_pb2 as pb
from gateway.service.server import GatewayServer, ServeError
from tests.gateway.grpc_harness import (
    ADMIN_KEY,
    BLOCK,
    KEY_A,
    KEYS,
    RunningGateway,
    metadata,
    start_gateway,
    tiny_model,
)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    loaded: LoadedModel = tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    running = start_gateway(loaded, engine_config=EngineConfig(block_tokens=BLOCK,
                                                               route="serial"),
                            admin_listener=True)
    try:
        yield running
    finally:
        running.stop()


def _call(port: int, method: str, request: bytes, api_key: str) -> grpc.StatusCode:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            channel.unary_unary(method)(request, metadata=metadata(api_key), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_the_admin_service_answers_on_its_own_port_only(gateway: RunningGateway) -> None:
    admin_port = gateway.server.admin_port
    assert admin_port is not None and admin_port != gateway.port
    stats = pb.StatsRequest().SerializeToString()
    assert _call(admin_port, "/kvgate.v1.Admin/Stats", stats, ADMIN_KEY) == grpc.StatusCode.OK
    assert _call(gateway.port, "/kvgate.v1.Admin/Stats", stats,
                 ADMIN_KEY) == grpc.StatusCode.UNIMPLEMENTED
    lookup = pb.LookupRequest(input=pb.PromptInput(prompt="hello")).SerializeToString()
    assert _call(gateway.port, "/kvgate.v1.Gateway/Lookup", lookup,
                 KEY_A) == grpc.StatusCode.OK
    assert _call(admin_port, "/kvgate.v1.Gateway/Lookup", lookup,
                 KEY_A) == grpc.StatusCode.UNIMPLEMENTED
    # and the Admin port still wants an admin key
    assert _call(admin_port, "/kvgate.v1.Admin/Stats", stats,
                 KEY_A) == grpc.StatusCode.PERMISSION_DENIED


def test_health_is_served_on_both_listeners(gateway: RunningGateway) -> None:
    assert gateway.server.admin_port is not None
    for port in (gateway.port, gateway.server.admin_port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_client_reaches_admin_through_admin_port(gateway: RunningGateway) -> None:
    with KvgateClient("127.0.0.1", gateway.port, ADMIN_KEY, admin_port=gateway.server.admin_port,
                      retry=RetryPolicy(max_attempts=1)) as client:
        assert client.stats().num_blocks >= 0
        assert client.lookup("hello").prompt_tokens > 0  # the Gateway service, on port


def test_a_plaintext_admin_listener_off_loopback_is_refused() -> None:
    config = ServeConfig(host="127.0.0.1", port=0, admin_host="0.0.0.0", admin_port=0,
                         keys=KEYS)
    with pytest.raises(ServeError, match="without TLS"):
        GatewayServer(config, Authenticator(KEYS)).start()
