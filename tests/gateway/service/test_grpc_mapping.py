"""Protobuf ↔ engine records, at the servicer's edge (no server, no model)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.client import prompt_message, stream_item
from gateway.config.keys import Principal
from gateway.config.limits import LimitSettings
from gateway.core.errors import InvalidRequest, PermissionDenied
from gateway.core.fingerprint import Scope
from gateway.core.prompt_limits import PromptLimits, PromptSize, check_prompt_size, measure
from gateway.core.requests import LookupResult, SamplingParams, TokenDelta, Usage
from gateway.service.admission import Admission
from gateway.service.auth import Authenticator
from gateway.service.call_gate import BodyWatchdog, CallGate
from gateway.service.dispatch import ServicerSet
from gateway.service.edge import EdgeLimits
from gateway.service.engine_slot import EngineSlot
from gateway.service.pb import kvgate_pb2 as pb
from gateway.service.servicer import (
    ADMIN_SERVICE,
    GATEWAY_SERVICE,
    delta_message,
    generate_request,
    lookup_response,
    priority_of,
    prompt_input,
    sampling_params,
    scope_for,
    ttl_seconds,
    usage_message,
)

TENANT = Principal(tenant="tenant-a")
ADMIN = Principal(tenant="ops", is_admin=True)


def test_unset_sampling_fields_take_the_defaults_and_zero_is_a_value() -> None:
    assert sampling_params(pb.SamplingParams()) == SamplingParams()
    params = sampling_params(pb.SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9,
                                               top_k=3, seed=0, stop=["\n\n"]))
    assert params == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=0,
                                    stop=("\n\n",))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        sampling_params(pb.SamplingParams(max_tokens=0))


def test_every_bad_sampling_field_is_named_in_one_message() -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        sampling_params(pb.SamplingParams(max_tokens=-1, temperature=math.nan, top_p=2, top_k=-1,
                                          seed=-5))
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert name in str(excinfo.value)


def test_prompt_fields_left_empty_are_not_sent() -> None:
    record = prompt_input(pb.PromptInput(prompt="hi"))
    assert (record.prompt, record.messages, record.token_ids, record.tools) == \
        ("hi", None, None, None)
    assert record.add_generation_prompt is True
    assert prompt_input(pb.PromptInput(prompt="")).prompt == ""  # sent, and empty
    record = prompt_input(pb.PromptInput(
        messages=[pb.Message(role="user", content="hi")], add_generation_prompt=False,
        tools=['{"name": "f", "parameters": {"type": "object"}}']))
    assert record.messages == [{"role": "user", "content": "hi"}]
    assert record.add_generation_prompt is False
    assert record.tools == [{"name": "f", "parameters": {"type": "object"}}]
    assert prompt_input(pb.PromptInput(token_ids=[1, 2, 3])).token_ids == [1, 2, 3]


@pytest.mark.parametrize(
    ("tool", "hint"),
    [('{"a": ', "not valid JSON"), ("[]", "must be a JSON object"), ("3", "JSON int"),
     ('{"x": Infinity}', "not valid JSON"), ("[" * 50_000, "nested too deeply")],
)
def test_tool_schemas_must_be_json_objects(tool: str, hint: str) -> None:
    with pytest.raises(InvalidRequest, match=r"tools\[1\]") as excinfo:
        prompt_input(pb.PromptInput(messages=[pb.Message(role="user", content="x")],
                                    tools=["{}", tool]))
    assert hint in str(excinfo.value)


def test_too_many_tools() -> None:
    with pytest.raises(InvalidRequest, match="at most 128 tools"):
        prompt_input(pb.PromptInput(tools=["{}"] * 129))


def test_the_scope_comes_from_the_key() -> None:
    assert scope_for(TENANT, pb.SCOPE_UNSPECIFIED) == Scope.of_tenant("tenant-a")
    assert scope_for(TENANT, pb.SCOPE_TENANT) == Scope.of_tenant("tenant-a")
    assert scope_for(ADMIN, pb.SCOPE_TENANT) == Scope.of_tenant("ops")
    assert scope_for(ADMIN, pb.SCOPE_SHARED) == Scope.shared()
    with pytest.raises(PermissionDenied):
        scope_for(TENANT, pb.SCOPE_SHARED)
    with pytest.raises(InvalidRequest, match="unknown scope 7"):
        scope_for(TENANT, 7)


def test_ttl_bounds() -> None:
    limits = EdgeLimits(max_ttl_s=100.0)
    assert ttl_seconds(pb.CacheOptions(), limits) is None
    assert ttl_seconds(pb.CacheOptions(ttl_s=100.0), limits) == 100.0
    for bad in (0.0, -1.0, 100.5, math.inf, math.nan):
        with pytest.raises(InvalidRequest, match="ttl_s"):
            ttl_seconds(pb.CacheOptions(ttl_s=bad), limits)


def test_a_generate_requests_priority_is_0_unless_sent_and_bounded_at_the_edge() -> None:
    prompt = pb.PromptInput(prompt="hi")
    assert priority_of(pb.GenerateRequest(input=prompt)) == 0
    for value in (-1_000, -1, 0, 1_000):
        assert priority_of(pb.GenerateRequest(input=prompt, priority=value)) == value
    for bad in (-1_001, 1_001, 2**31 - 1):
        with pytest.raises(InvalidRequest, match="priority must be an integer from -1000 to"):
            generate_request(pb.GenerateRequest(input=prompt, priority=bad), TENANT,
                             deadline=None, limits=EdgeLimits())


def test_a_generate_request_carries_scope_cache_options_and_deadline() -> None:
    message = pb.GenerateRequest(
        input=pb.PromptInput(prompt="hi"),
        sampling=pb.SamplingParams(max_tokens=3),
        cache=pb.CacheOptions(ttl_s=5.0, no_cache=True, scope=pb.SCOPE_TENANT),
    )
    record = generate_request(message, TENANT, deadline=123.0, limits=EdgeLimits())
    assert record.scope == Scope.of_tenant("tenant-a")
    assert record.cache.no_cache and record.cache.ttl_s == 5.0
    assert record.sampling.max_tokens == 3 and record.deadline == 123.0


def test_allow_lossy_and_lossy_are_field_20_and_read_false_from_an_older_peer() -> None:
    """proto3 false is "exact": a request or usage written before the fields existed (here: one
    that never sets them) parses as exact, and a set field survives the wire."""
    assert pb.CacheOptions.DESCRIPTOR.fields_by_name["allow_lossy"].number == 20
    assert pb.Usage.DESCRIPTOR.fields_by_name["lossy"].number == 20
    older = pb.GenerateRequest(input=pb.PromptInput(prompt="hi"),
                               cache=pb.CacheOptions(no_cache=False)).SerializeToString()
    assert pb.GenerateRequest.FromString(older).cache.allow_lossy is False
    assert pb.Usage.FromString(pb.Usage(prompt_tokens=3).SerializeToString()).lossy is False
    wire = pb.CacheOptions(allow_lossy=True).SerializeToString()
    assert pb.CacheOptions.FromString(wire).allow_lossy is True
    assert pb.Usage.FromString(pb.Usage(lossy=True).SerializeToString()).lossy is True


def test_a_generate_request_carries_allow_lossy_to_the_engine_record() -> None:
    prompt = pb.PromptInput(prompt="hi")
    exact = generate_request(pb.GenerateRequest(input=prompt), TENANT, deadline=None,
                             limits=EdgeLimits())
    assert exact.cache.allow_lossy is False
    lossy = generate_request(pb.GenerateRequest(input=prompt, cache=pb.CacheOptions(
        allow_lossy=True, session_id="chat-1", ttl_s=5.0)), TENANT, deadline=None,
        limits=EdgeLimits())
    assert lossy.cache.allow_lossy is True
    assert (lossy.cache.session_id, lossy.cache.ttl_s) == ("chat-1", 5.0)


def test_a_lossy_usage_and_its_format_tiers_round_trip_through_the_client() -> None:
    usage = Usage(prompt_tokens=2100, cached_tokens=2048,
                  cached_tokens_by_tier={"device": 128, "disk:int8": 1920}, completion_tokens=3,
                  ttft_ms=1.5, total_ms=9.25, finish_reason="length", lossy=True)
    message = usage_message(usage)
    assert message.usage.lossy is True
    wire = pb.GenerateResponse.FromString(message.SerializeToString())
    assert stream_item(wire) == usage


def test_stream_messages_round_trip_through_the_client() -> None:
    delta = TokenDelta(token_ids=(5, 6), text="hé")
    wire = pb.GenerateResponse.FromString(delta_message(delta).SerializeToString())
    assert stream_item(wire) == delta
    usage = Usage(prompt_tokens=40, cached_tokens=32, cached_tokens_by_tier={"device": 16,
                  "disk": 16}, completion_tokens=3, ttft_ms=1.5, total_ms=9.25,
                  finish_reason="eos")
    wire = pb.GenerateResponse.FromString(usage_message(usage).SerializeToString())
    assert stream_item(wire) == usage


def test_lookup_response_keeps_unset_divergence_unset() -> None:
    result = LookupResult(prompt_tokens=40, cached_tokens=32, cached_tokens_by_tier={"host": 32},
                          num_prompt_blocks=2, diverges_at_block=None, diverges_at_token=None,
                          text_around_divergence="")
    message = lookup_response(result)
    assert not message.HasField("diverges_at_block")
    diverged = lookup_response(LookupResult(
        prompt_tokens=40, cached_tokens=0, cached_tokens_by_tier={}, num_prompt_blocks=2,
        diverges_at_block=0, diverges_at_token=0, text_around_divergence="abc"))
    assert diverged.HasField("diverges_at_block") and diverged.diverges_at_block == 0


def test_the_client_writes_tool_objects_as_json() -> None:
    message = prompt_message(None, [{"role": "user", "content": "x"}], None,
                             [{"name": "f"}, '{"raw": 1}'], None)
    assert list(message.tools) == ['{"name": "f"}', '{"raw": 1}']
    assert not message.HasField("prompt") and not message.HasField("add_generation_prompt")


def test_every_rpc_of_the_proto_has_a_handler() -> None:
    with ThreadPoolExecutor(1) as pool:
        gate = CallGate(Authenticator([]), Admission(LimitSettings()), BodyWatchdog(1.0),
                        worker_pool=pool, refusal_pool=pool)
        handlers = ServicerSet(EngineSlot(), EdgeLimits()).keyed_services(gate)
    assert [h.service_name() for h in handlers] == [GATEWAY_SERVICE, ADMIN_SERVICE]


# ---- limits before work: counted on the protobuf, before anything is parsed or rendered -----

SMALL = EdgeLimits(prompt=PromptLimits(max_chars=100, max_messages=3))


def test_a_prompt_over_max_prompt_chars_is_refused_at_the_edge() -> None:
    message = pb.GenerateRequest(input=pb.PromptInput(prompt="x" * 101))
    with pytest.raises(InvalidRequest, match=r"101 characters.*at most 100 \(limits.max_prompt"):
        generate_request(message, TENANT, deadline=None, limits=SMALL)
    generate_request(pb.GenerateRequest(input=pb.PromptInput(prompt="x" * 100)), TENANT,
                     deadline=None, limits=SMALL)


def test_message_contents_roles_and_tool_text_count_as_prompt_characters() -> None:
    messages = [pb.Message(role="user", content="y" * 40)] * 2  # 2 x (4 + 40) = 88
    tools = ['{"name": "f"}']  # 13 more: 101
    with pytest.raises(InvalidRequest, match="limits.max_prompt_chars"):
        prompt_input(pb.PromptInput(messages=messages, tools=tools), SMALL.prompt)
    assert prompt_input(pb.PromptInput(messages=messages), SMALL.prompt).messages


def test_more_messages_than_max_messages_are_refused_before_a_tool_is_parsed() -> None:
    message = pb.PromptInput(messages=[pb.Message(role="user", content="hi")] * 4,
                             tools=["{not json"])
    with pytest.raises(InvalidRequest, match=r"4 messages; send at most 3 \(limits.max_messages"):
        prompt_input(message, SMALL.prompt)


def test_measure_counts_a_built_prompt_like_the_protobuf_edge_does() -> None:
    record = prompt_input(pb.PromptInput(messages=[pb.Message(role="system", content="abc")],
                                         tools=['{"name": "f"}']))
    assert measure(record) == PromptSize(num_chars=6 + 3 + len('{"name":"f"}'), num_messages=1)
    with pytest.raises(InvalidRequest):
        check_prompt_size(measure(record), PromptLimits(max_chars=10))
