"""kvgate.v1 over a real gRPC channel: auth, every INVALID_ARGUMENT, abuse, tenants, concurrency.

One real gateway per module (tiny Llama, real cache and engine, 16-token blocks) on a free
loopback port, stopped when the module ends; tests that need other settings start their own.
docs/reliability.md test groups D (tenants, authN/Z on every RPC, nothing secret in logs) and E (API
abuse: every numeric field out of range, over-size, malformed protobuf, disconnects, deadlines;
after each the server is alive and SERVING).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from gateway.client import (
    DeadlineExceeded,
    InvalidArgument,
    KvgateClient,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from gateway.config.limits import LimitSettings
from gateway.config.settings import GrpcSettings, ServeConfig
from gateway.core.requests import TokenDelta, Usage
from gateway.engine.engine import EngineConfig
from gateway.engine.models.loading import LoadedModel
from gateway.service.auth import Authenticator
from gateway.service.pb import kvgate_pb2 as pb
from gateway.service.server import GatewayServer, ServeError
from tests.gateway.grpc_harness import (
    ADMIN_KEY,
    ALL_KEYS,
    BLOCK,
    KEY_A,
    KEY_B,
    KEYS,
    LONG_PROMPT,
    RunningGateway,
    metadata,
    start_gateway,
    tiny_model,
    wait_until,
)
from tests.tiny_llama import VOCAB

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def gateway(loaded: LoadedModel) -> Iterator[RunningGateway]:
    # The fuzz tests send hundreds of Lookups in a row: above the default Lookup rate per key.
    running = start_gateway(loaded, limits=LimitSettings(lookups_per_s=1000, lookup_burst=1000))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def tenant_a(gateway: RunningGateway) -> KvgateClient:
    return gateway.client(KEY_A)


@pytest.fixture
def tenant_b(gateway: RunningGateway) -> KvgateClient:
    return gateway.client(KEY_B)


@pytest.fixture
def admin(gateway: RunningGateway) -> KvgateClient:
    return gateway.client(ADMIN_KEY)


def unique(text: str) -> str:
    """``text`` behind a random first line, so that no other test has cached it."""
    return f"[{random.randrange(10**12)}] {text}"


def assert_healthy(gateway: RunningGateway) -> None:
    """The server is alive, SERVING, holds no leases, and answers a good request."""
    assert gateway.health() == SERVING
    assert wait_until(lambda: gateway.total_refcount() == 0, timeout_s=5.0)
    text, usage = gateway.client(KEY_A).generate_text("still serving?", max_tokens=3)
    assert usage.completion_tokens >= 1


# ---- health, reflection -------------------------------------------------------------------


def test_health_is_serving_for_the_server_and_both_services(gateway: RunningGateway) -> None:
    for service in ("", "kvgate.v1.Gateway", "kvgate.v1.Admin"):
        assert gateway.health(service) == SERVING


def test_reflection_lists_the_kvgate_services(gateway: RunningGateway) -> None:
    database = ProtoReflectionDescriptorDatabase(gateway.channel())
    services = set(database.get_services())
    assert {"kvgate.v1.Gateway", "kvgate.v1.Admin", "grpc.health.v1.Health"} <= services
    generate = database.FindFileContainingSymbol("kvgate.v1.Gateway")
    assert generate.name == "kvgate/v1/kvgate.proto"


def test_a_server_without_its_model_is_not_serving_and_calls_are_unavailable() -> None:
    loading = start_gateway(None)
    try:
        assert loading.health() == NOT_SERVING
        with pytest.raises(Unavailable, match="still loading"):
            loading.client(KEY_A).generate_text("hello", max_tokens=1)
        with pytest.raises(Unavailable):
            loading.client(ADMIN_KEY).stats()
    finally:
        loading.stop()


# ---- authentication and authorisation on every RPC ----------------------------------------


def _all_methods() -> list[tuple[str, str, bool]]:
    out = []
    for service in pb.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            out.append((service.full_name, method.name, method.server_streaming))
    return out


def _raw_call(gateway: RunningGateway, service: str, method: str, streaming: bool,
              request: bytes, api_key: str | None) -> grpc.StatusCode:
    """Call with raw request bytes (no serializer) and return the status code."""
    channel = gateway.channel()
    path = f"/{service}/{method}"
    try:
        if streaming:
            for _ in channel.unary_stream(path)(request, metadata=metadata(api_key), timeout=10):
                pass
        else:
            channel.unary_unary(path)(request, metadata=metadata(api_key), timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(("service", "method", "streaming"), _all_methods())
@pytest.mark.parametrize("api_key", [None, "not-a-key-of-this-gateway-000000"])
def test_every_rpc_refuses_a_missing_or_unknown_key(
    gateway: RunningGateway, service: str, method: str, streaming: bool, api_key: str | None
) -> None:
    code = _raw_call(gateway, service, method, streaming, b"", api_key)
    assert code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("service", "method", "streaming"),
    [m for m in _all_methods() if m[0] == "kvgate.v1.Admin"],
)
def test_every_admin_rpc_refuses_a_tenant_key(
    gateway: RunningGateway, service: str, method: str, streaming: bool
) -> None:
    assert _raw_call(gateway, service, method, streaming, b"", KEY_A) == \
        grpc.StatusCode.PERMISSION_DENIED


def test_a_malformed_authorization_header_is_unauthenticated(gateway: RunningGateway) -> None:
    stub_call = gateway.channel().unary_unary("/kvgate.v1.Gateway/Lookup")
    for value in (f"Basic {KEY_A}", KEY_A, "Bearer", "Bearer  "):
        with pytest.raises(grpc.RpcError) as excinfo:
            stub_call(b"", metadata=(("authorization", value),), timeout=5)
        assert excinfo.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "Bearer" in excinfo.value.details()


@pytest.mark.parametrize("tenant", ["", " tenant-a", "tenant-a\n", "a\x00b", "t" * 129])
def test_tenant_ids_in_admin_requests_are_checked_like_configured_ones(
    admin: KvgateClient, tenant: str,
) -> None:
    calls: list[Callable[[], object]] = [lambda: admin.set_quota(tenant, 1 << 20)]
    if tenant:  # an empty tenant means "not sent" to these three
        calls += [lambda: admin.pin(LONG_PROMPT, tenant=tenant),
                  lambda: admin.list_prefixes(tenant=tenant),
                  lambda: admin.evict(tenant=tenant)]
    for call in calls:
        with pytest.raises(InvalidArgument):
            call()
    with pytest.raises(InvalidArgument, match="reserved"):
        admin.set_quota("shared", 1 << 20)
    admin.list_prefixes(tenant="shared")  # the shared scope's owner may be listed


def test_the_shared_scope_and_pinning_need_an_admin_key(tenant_a: KvgateClient) -> None:
    with pytest.raises(PermissionDenied, match="admin key"):
        tenant_a.generate_text(LONG_PROMPT, max_tokens=1, shared=True)
    with pytest.raises(PermissionDenied, match="admin key"):
        tenant_a.warm(LONG_PROMPT, shared=True)
    with pytest.raises(PermissionDenied, match="admin key"):
        tenant_a.lookup(LONG_PROMPT, shared=True)
    with pytest.raises(PermissionDenied, match="pinning"):
        tenant_a.warm(LONG_PROMPT, pin=True)


def test_keys_and_prompts_never_appear_in_logs(
    gateway: RunningGateway, caplog: pytest.LogCaptureFixture
) -> None:
    secret_prompt = unique("the launch code is swordfish-7781")
    with caplog.at_level(logging.DEBUG):
        gateway.client(KEY_A).generate_text(secret_prompt, max_tokens=2)
        with pytest.raises(Unauthenticated):
            gateway.client("wrong-" + KEY_A).generate_text(secret_prompt, max_tokens=2)
        with pytest.raises(PermissionDenied):
            gateway.client(KEY_B).stats()
        with pytest.raises(InvalidArgument):
            gateway.client(KEY_B).generate_text(secret_prompt, max_tokens=0)
        with pytest.raises(InvalidArgument):
            gateway.client(KEY_B).generate(messages=[{"role": secret_prompt, "content": "x"}])\
                .__next__()
    assert caplog.records, "the servicer should log rejected calls at DEBUG"
    for key in ALL_KEYS:
        assert key not in caplog.text
    assert "swordfish" not in caplog.text


# ---- every INVALID_ARGUMENT, over the wire ------------------------------------------------

_INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("empty prompt", {"prompt": ""}, "`prompt` is empty"),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, "not a known role"),
    ("no input", {}, "exactly one of"),
    ("two inputs", {"prompt": "hi", "token_ids": [1, 2]}, "exactly one of"),
    ("messages and prompt", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]},
     "exactly one of"),
    ("token id past the vocabulary", {"token_ids": [1, VOCAB]}, "outside this model's vocab"),
    ("negative token id", {"token_ids": [-1]}, "outside this model's vocab"),
    ("prompt longer than the context", {"token_ids": [5] * 2100}, "limit of 2047 tokens"),
    ("prompt plus max_tokens over the context", {"token_ids": [5] * 2000, "max_tokens": 100},
     "context"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens -1", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("max_tokens huge", {"prompt": "hi", "max_tokens": 2**62}, "max_tokens"),
    ("temperature NaN", {"prompt": "hi", "temperature": math.nan}, "temperature"),
    ("temperature -1", {"prompt": "hi", "temperature": -1.0}, "temperature"),
    ("temperature inf", {"prompt": "hi", "temperature": math.inf}, "temperature"),
    ("top_p 0", {"prompt": "hi", "top_p": 0.0}, "top_p"),
    ("top_p 2", {"prompt": "hi", "top_p": 2.0}, "top_p"),
    ("top_p NaN", {"prompt": "hi", "top_p": math.nan}, "top_p"),
    ("top_k -1", {"prompt": "hi", "top_k": -1}, "top_k"),
    ("seed -1", {"prompt": "hi", "seed": -1}, "seed"),
    ("17 stop strings", {"prompt": "hi", "stop": ["x"] * 17}, "stop"),
    ("priority -1001", {"prompt": "hi", "priority": -1001}, "priority must be an integer from"),
    ("priority 1001", {"prompt": "hi", "priority": 1001}, "priority must be an integer from"),
    ("ttl -1", {"prompt": "hi", "ttl_s": -1.0}, "ttl_s"),
    ("ttl NaN", {"prompt": "hi", "ttl_s": math.nan}, "ttl_s"),
    ("ttl of years", {"prompt": "hi", "ttl_s": 1e9}, "ttl_s"),
    ("malformed tool JSON",
     {"messages": [{"role": "user", "content": "hi"}], "tools": ['{"name": "f", ']},
     "tools[0] is not valid JSON"),
    ("tool JSON that is not an object",
     {"messages": [{"role": "user", "content": "hi"}], "tools": ["[1, 2]"]},
     "must be a JSON object"),
    ("tool JSON with NaN",
     {"messages": [{"role": "user", "content": "hi"}], "tools": ['{"x": NaN}']},
     "not valid JSON"),
    ("tool JSON nested too deeply",
     {"messages": [{"role": "user", "content": "hi"}], "tools": ['{"a":' * 50_000]},
     "not valid JSON"),  # deeper than the parser goes, within limits.max_prompt_chars
    ("tools with a raw prompt", {"prompt": "hi", "tools": ['{"name": "f"}']}, "`tools`"),
]


@pytest.mark.parametrize(("fields", "hint"), [(f, h) for _, f, h in _INVALID],
                         ids=[name for name, _, _ in _INVALID])
def test_generate_refuses_with_an_actionable_invalid_argument(
    gateway: RunningGateway, tenant_a: KvgateClient, fields: dict[str, Any], hint: str
) -> None:
    with pytest.raises(InvalidArgument) as excinfo:
        tenant_a.generate_text(**fields)
    assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert hint in excinfo.value.details


def test_warm_and_lookup_check_their_prompts_too(tenant_a: KvgateClient) -> None:
    with pytest.raises(InvalidArgument, match="exactly one of"):
        tenant_a.warm()
    with pytest.raises(InvalidArgument, match="not a known role"):
        tenant_a.lookup(messages=[{"role": "root", "content": "x"}])
    with pytest.raises(InvalidArgument, match="ttl_s"):
        tenant_a.warm("hello", ttl_s=0.0)


def test_a_request_over_4_mib_is_resource_exhausted_and_harmless(
    gateway: RunningGateway, tenant_a: KvgateClient
) -> None:
    with pytest.raises(ResourceExhausted):
        tenant_a.generate_text("a" * (5 << 20), max_tokens=1)
    assert_healthy(gateway)


def test_malformed_protobuf_bytes_are_invalid_argument_and_the_server_lives_on(
    gateway: RunningGateway,
) -> None:
    broken = [
        b"\xff\xff\xff\xff",  # a field tag that never ends
        b"\x0a\x05\x12\x03ab",  # input.prompt: a length past the end
        b"\x0a\x04\x12\x02\xc3\x28",  # input.prompt: invalid UTF-8
        b"\x0a\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80",  # a varint length of 11 bytes
    ]
    for blob in broken:
        code = _raw_call(gateway, "kvgate.v1.Gateway", "Generate", True, blob, KEY_A)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, blob
    rng = random.Random(1234)
    for _ in range(200):  # fuzz the no-compute RPC: every answer is OK or INVALID_ARGUMENT
        blob = rng.randbytes(rng.randrange(1, 64))
        code = _raw_call(gateway, "kvgate.v1.Gateway", "Lookup", False, blob, KEY_A)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), blob
    assert_healthy(gateway)


# ---- tenants ------------------------------------------------------------------------------


def test_tenants_are_isolated_with_a_positive_control(
    tenant_a: KvgateClient, tenant_b: KvgateClient
) -> None:
    prompt = unique(LONG_PROMPT)
    cold_text, cold = tenant_a.generate_text(prompt, max_tokens=8)
    assert cold.cached_tokens == 0
    warm_text, warm = tenant_a.generate_text(prompt, max_tokens=8)
    assert warm.cached_tokens > 0 and warm.cached_tokens % BLOCK == 0  # positive control
    assert warm.cached_tokens_by_tier == {"device": warm.cached_tokens}
    assert warm_text == cold_text
    assert tenant_a.lookup(prompt).cached_tokens == warm.cached_tokens

    assert tenant_b.lookup(prompt).cached_tokens == 0
    b_text, b_first = tenant_b.generate_text(prompt, max_tokens=8)
    assert b_first.cached_tokens == 0
    assert b_text == cold_text
    _, b_again = tenant_b.generate_text(prompt, max_tokens=8)
    assert b_again.cached_tokens == warm.cached_tokens  # B stored its own copy


def test_a_prompt_warmed_in_the_shared_scope_is_a_hit_for_every_tenant(
    admin: KvgateClient, tenant_a: KvgateClient, tenant_b: KvgateClient
) -> None:
    prompt = unique(LONG_PROMPT)
    warmed = admin.warm(prompt, shared=True)
    assert warmed.num_new_blocks > 0
    assert admin.lookup(prompt, shared=True).cached_tokens == warmed.num_blocks * BLOCK
    assert set(admin.lookup(prompt, shared=True).cached_tokens_by_tier) == {"device"}
    for client in (tenant_a, tenant_b):
        looked_up = client.lookup(prompt)
        assert looked_up.cached_tokens > 0
        # Which tier holds a shared block depends on what other tenants used: not said.
        assert looked_up.cached_tokens_by_tier == {"shared": looked_up.cached_tokens}
        _, usage = client.generate_text(prompt, max_tokens=2)
        assert usage.cached_tokens > 0
        assert usage.cached_tokens_by_tier == {"shared": usage.cached_tokens}


def test_warm_then_lookup_reports_blocks_tiers_and_divergence(tenant_a: KvgateClient) -> None:
    prompt = unique(LONG_PROMPT)
    warmed = tenant_a.warm(prompt)
    assert warmed.num_blocks == warmed.prompt_tokens // BLOCK
    assert warmed.num_new_blocks == warmed.num_blocks and warmed.stored_bytes > 0
    again = tenant_a.warm(prompt)
    assert again.num_cached_blocks == warmed.num_blocks and again.num_new_blocks == 0

    hit = tenant_a.lookup(prompt)
    assert hit.cached_tokens == warmed.num_blocks * BLOCK
    assert hit.cached_tokens_by_tier == {"device": hit.cached_tokens}
    assert hit.diverges_at_block is None

    changed = prompt[:60] + "X" + prompt[61:]  # a change inside the 2nd..4th block
    partial = tenant_a.lookup(changed)
    assert partial.diverges_at_block is not None
    assert 0 < partial.cached_tokens == partial.diverges_at_block * BLOCK
    assert partial.diverges_at_token == partial.diverges_at_block * BLOCK
    assert partial.text_around_divergence


def test_no_cache_stores_nothing(tenant_a: KvgateClient) -> None:
    prompt = unique(LONG_PROMPT)
    _, first = tenant_a.generate_text(prompt, max_tokens=4, no_cache=True)
    assert first.cached_tokens == 0
    assert tenant_a.lookup(prompt).cached_tokens == 0
    _, second = tenant_a.generate_text(prompt, max_tokens=4, no_cache=True)
    assert second.cached_tokens == 0


def test_allow_lossy_without_a_lossy_tier_is_answered_exactly_from_the_exact_blocks(
    tenant_a: KvgateClient,
) -> None:
    """No tier of this gateway keeps lossy copies: a request that allows them reads the exact
    chain, as any request, and its answer is the exact one, said to be exact."""
    prompt = unique(LONG_PROMPT)
    exact_text, cold = tenant_a.generate_text(prompt, max_tokens=6)
    text, usage = tenant_a.generate_text(prompt, max_tokens=6, allow_lossy=True)
    assert text == exact_text
    assert usage.lossy is False and cold.lossy is False
    assert usage.cached_tokens > 0 and usage.cached_tokens_by_tier == {
        "device": usage.cached_tokens}


# ---- admin --------------------------------------------------------------------------------


def test_admin_lists_pins_evicts_and_flushes(
    admin: KvgateClient, tenant_a: KvgateClient, tenant_b: KvgateClient
) -> None:
    prompt_a, prompt_b = unique(LONG_PROMPT), unique(LONG_PROMPT)
    warmed = tenant_a.warm(prompt_a)
    tenant_b.warm(prompt_b)

    stats = admin.stats()
    assert [t.name for t in stats.tiers] == ["device", "host"]
    assert stats.num_blocks >= 2 * warmed.num_blocks
    listed = admin.list_prefixes(tenant="tenant-a", limit=1000)
    assert listed and {p.tenant for p in listed} == {"tenant-a"}
    assert any(p.num_blocks >= warmed.num_blocks for p in listed)

    assert admin.pin(prompt_a, tenant="tenant-a") == warmed.num_blocks
    assert admin.pin(prompt_a, tenant="tenant-a") == 0  # already pinned
    assert admin.pin(prompt_a, tenant="tenant-a", unpin=True) == warmed.num_blocks
    admin.set_quota("tenant-b", 1 << 30)
    admin.set_quota("tenant-b", None)
    with pytest.raises(NotFound, match="no tenant 'tenant-z': this gateway has keys for "):
        admin.set_quota("tenant-z", 1 << 30)

    evicted = admin.evict(tenant="tenant-b")
    assert evicted.num_blocks >= warmed.num_blocks
    assert tenant_b.lookup(prompt_b).cached_tokens == 0
    assert tenant_a.lookup(prompt_a).cached_tokens > 0  # another tenant's eviction spares A

    with pytest.raises(InvalidArgument, match="evict"):
        admin.evict()
    with pytest.raises(InvalidArgument, match="tier"):
        admin.evict(tier="floppy")
    with pytest.raises(InvalidArgument, match="key_hex"):
        admin.evict(key_hex="not hex")
    with pytest.raises(InvalidArgument, match="limit"):
        admin.list_prefixes(limit=5000)
    with pytest.raises(InvalidArgument, match="num_bytes"):
        admin.set_quota("tenant-a", -1)

    admin.flush()
    assert admin.stats().num_blocks == 0
    assert tenant_a.lookup(prompt_a).cached_tokens == 0


def test_an_eviction_by_a_prefix_longer_than_a_prompt_is_invalid_argument(
    admin: KvgateClient,
) -> None:
    most = LimitSettings().max_prompt_chars  # this gateway's limits.max_prompt_chars
    with pytest.raises(InvalidArgument, match=rf"prefix_text has {most + 1} characters; a prefix "
                       rf"is bounded like a prompt: send at most {most} "
                       r"\(limits.max_prompt_chars\)"):
        admin.evict(tenant="tenant-a", prefix_text="x" * (most + 1))


# ---- disconnects, deadlines, concurrency --------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(
    gateway: RunningGateway, tenant_a: KvgateClient
) -> None:
    prompt = unique(LONG_PROMPT)
    tenant_a.warm(prompt)
    stream = tenant_a.generate(prompt, max_tokens=1900)  # seconds of decoding
    first = next(stream)
    assert isinstance(first, TokenDelta)
    assert gateway.total_refcount() > 0  # positive control: the running request holds blocks
    stream.close()  # cancels the call: the client goes away
    began = time.monotonic()
    assert wait_until(lambda: gateway.total_refcount() == 0, timeout_s=10.0)
    assert time.monotonic() - began < 1.0, "the engine should stop at once, not decode on"
    assert_healthy(gateway)


def test_a_client_deadline_mid_decode_is_deadline_exceeded(
    gateway: RunningGateway, tenant_a: KvgateClient
) -> None:
    # A random model may produce its end-of-sequence token early, and a loaded machine may
    # spend the deadline before the first token: try prompts until the deadline cuts a
    # generation off after tokens have streamed.
    for _ in range(8):
        decoded: list[TokenDelta] = []
        try:
            for item in tenant_a.generate(unique(LONG_PROMPT), max_tokens=1900, timeout_s=0.5,
                                          no_cache=True):
                if isinstance(item, TokenDelta):
                    decoded.append(item)
        except DeadlineExceeded:
            if decoded:
                break
    else:
        pytest.fail("no generation was cut off mid-decode by a deadline")
    assert_healthy(gateway)


def test_eight_concurrent_streams_match_their_sequential_outputs(
    gateway: RunningGateway,
) -> None:
    prompts = [unique(f"{LONG_PROMPT} Question {i}: what comes next?") for i in range(8)]
    sequential = {}
    for prompt in prompts:
        sequential[prompt] = _stream_tokens(gateway.client(KEY_A), prompt)
    results: dict[str, tuple[list[int], Usage]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def run(prompt: str) -> None:
        try:
            client = gateway.client(KEY_A)
            start.wait()
            results[prompt] = _stream_tokens(client, prompt)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    for prompt in prompts:
        tokens, usage = results[prompt]
        assert tokens == sequential[prompt][0]
        assert usage.cached_tokens > 0  # the sequential run cached every prompt
    assert_healthy(gateway)


def _stream_tokens(client: KvgateClient, prompt: str) -> tuple[list[int], Usage]:
    tokens: list[int] = []
    usage = None
    for item in client.generate(prompt, max_tokens=24):
        if isinstance(item, TokenDelta):
            tokens.extend(item.token_ids)
        else:
            usage = item
    assert usage is not None
    return tokens, usage


def test_the_server_bounds_deadlines_and_refuses_new_work_while_draining(
    loaded: LoadedModel,
) -> None:
    short = start_gateway(
        loaded,
        grpc_settings=GrpcSettings(max_deadline_s=0.3, max_connection_age_grace_s=1.0),
        engine_config=EngineConfig(block_tokens=BLOCK, max_deadline_s=600.0),
    )
    try:
        client = short.client(KEY_A, timeout_s=60.0)  # the client would wait a minute
        began = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.generate_text(LONG_PROMPT, max_tokens=1900)
        assert time.monotonic() - began < 5.0
        assert short.health() == SERVING

        assert short.engine is not None
        short.engine.stop(grace_s=1.0)
        with pytest.raises(Unavailable, match="shutting down"):
            client.generate_text(LONG_PROMPT, max_tokens=2)
        stopped = short.server.begin_shutdown()
        assert stopped.wait(5.0)
    finally:
        short.stop()


def test_a_tls_free_remote_listener_is_refused() -> None:
    server = GatewayServer(ServeConfig(host="0.0.0.0", port=0, keys=KEYS), Authenticator(KEYS))
    with pytest.raises(ServeError, match="without TLS"):
        server.start()


def test_an_answers_blocks_are_cached_by_the_time_it_ends(
        gateway: RunningGateway, tenant_a: KvgateClient) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(3, 400) for _ in range(2 * BLOCK + 5)]
    answer: list[int] = []
    for item in tenant_a.generate(token_ids=prompt, max_tokens=3 * BLOCK):
        if isinstance(item, TokenDelta):
            answer.extend(item.token_ids)
    follow_up = prompt + answer
    full_blocks = (len(follow_up) // BLOCK) * BLOCK
    assert full_blocks > 3 * BLOCK  # the answer filled blocks of its own
    assert gateway.engine is not None
    # The last generated token is never fed back, so its block waits for the next turn.
    stored_as_decoded = ((len(follow_up) - 1) // BLOCK) * BLOCK
    route = gateway.engine.route
    if route.decode_kv_is_prefill_kv:
        # Decoding wrote the K/V a prefill writes: the answer's blocks are stored as decoded.
        expected = stored_as_decoded
    elif route.name == "serial":
        # The serial route recomputes the answer's blocks block-aligned once it has ended.
        assert wait_until(
            lambda: tenant_a.lookup(token_ids=follow_up).cached_tokens == stored_as_decoded,
            timeout_s=5.0), tenant_a.lookup(token_ids=follow_up)
        expected = stored_as_decoded
    else:
        # Decode rows were products of their own: the next turn, which sends the answer
        # back, stores its blocks.
        expected = 2 * BLOCK
    assert tenant_a.lookup(token_ids=follow_up).cached_tokens == expected
    _, usage = tenant_a.generate_text(token_ids=follow_up + [5], max_tokens=1)
    if route.decode_kv_is_prefill_kv:
        # ... and the next turn starts after the tail the engine kept: every position that
        # holds K/V (the last answer token and the new one are computed).
        assert usage.cached_tokens == len(follow_up) - 1
    else:
        assert usage.cached_tokens == expected
    assert wait_until(lambda: tenant_a.lookup(token_ids=follow_up).cached_tokens == full_blocks,
                      timeout_s=5.0), tenant_a.lookup(token_ids=follow_up)


def test_calls_past_a_keys_limit_are_resource_exhausted(loaded: LoadedModel) -> None:
    narrow = start_gateway(loaded, limits=LimitSettings(max_calls_per_key=1))
    try:
        client = narrow.client(KEY_A)
        stream = client.generate(LONG_PROMPT, max_tokens=1900)
        assert isinstance(next(stream), TokenDelta)  # the one allowed call is in flight
        with pytest.raises(ResourceExhausted, match="max_calls_per_key"):
            client.lookup("hello")
        narrow.client(KEY_B).lookup("hello")  # another key is not held up
        stream.close()
        assert wait_until(lambda: narrow.total_refcount() == 0)
        assert wait_until(lambda: _lookup_succeeds(client), timeout_s=5.0)
    finally:
        narrow.stop()


def _lookup_succeeds(client: KvgateClient) -> bool:
    try:
        client.lookup("hello")
    except ResourceExhausted:
        return False
    return True
