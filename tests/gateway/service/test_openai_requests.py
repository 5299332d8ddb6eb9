"""OpenAI request bodies -> engine records, at the HTTP front's edge (no server, no model)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.config.keys import Principal
from gateway.core.fingerprint import Scope
from gateway.core.requests import CacheOptions, SamplingParams
from gateway.service.edge import EdgeLimits
from gateway.service.http.errors import InvalidParam
from gateway.service.http.openai_requests import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    parse_call,
)

TENANT = Principal(tenant="tenant-a")
LIMITS = EdgeLimits(max_deadline_s=60.0, max_ttl_s=100.0)


def chat(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_call("chat", body, TENANT, limits=LIMITS)


def test_a_chat_becomes_the_messages_sampling_and_cache_options_grpc_would_send() -> None:
    call = chat(messages=[{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}],
                max_completion_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop="\n",
                stream=True, stream_options={"include_usage": True},
                kvgate={"no_cache": True, "ttl_s": 50, "top_k": 4})
    request = call.request
    assert request.prompt.messages == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "a\nb"}]
    assert request.sampling == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=4,
                                              seed=3, stop=("\n",))
    assert request.cache == CacheOptions(no_cache=True, ttl_s=50.0)
    assert request.scope == Scope.of_tenant("tenant-a")
    assert (call.stream, call.include_usage) == (True, True)


def test_null_fields_are_not_sent_and_the_deadline_is_the_servers_at_most() -> None:
    call = chat(temperature=None, n=None, tools=None, kvgate={"timeout_s": 10_000})
    assert call.request.sampling == SamplingParams()
    assert call.request.deadline is not None
    assert call.request.deadline <= time.monotonic() + LIMITS.max_deadline_s


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    call = chat(presence_penalty=0, frequency_penalty=0.0, logprobs=False, logit_bias={},
                response_format={"type": "text"}, n=1, user="u-1", parallel_tool_calls=True)
    assert call.request.sampling == SamplingParams()


def test_priority_is_a_body_field_as_vllm_takes_it_0_unless_sent() -> None:
    assert chat().request.priority == 0
    assert chat(priority=-5).request.priority == -5
    assert chat(priority=None).request.priority == 0


@pytest.mark.parametrize("priority", [1_001, -1_001, 1.5, "high", True])
def test_a_priority_out_of_range_or_not_an_integer_is_refused_naming_it(priority: Any) -> None:
    with pytest.raises(InvalidParam) as excinfo:
        chat(priority=priority)
    assert excinfo.value.param == "priority"


@pytest.mark.parametrize(("prompt", "expected"), [
    ("text", {"prompt": "text"}),
    (["text"], {"prompt": "text"}),
    ([1, 2, 3], {"token_ids": [1, 2, 3]}),
    ([[1, 2]], {"token_ids": [1, 2]}),
])
def test_a_completion_prompt_is_text_or_token_ids(prompt: Any, expected: dict[str, Any]) -> None:
    call = parse_call("completion", {"model": "m", "prompt": prompt}, TENANT, limits=LIMITS)
    for name, value in expected.items():
        assert getattr(call.request.prompt, name) == value
    assert call.request.sampling.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS


@pytest.mark.parametrize(("kind", "body", "param"), [
    ("completion", {"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ("completion", {"model": "m", "prompt": "a", "echo": True}, "echo"),
    ("completion", {"model": "m", "messages": []}, "messages"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "x"},
     "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("chat", {"model": "m", "messages": [{"role": "assistant", "content": None,
                                          "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
              "tools": [{"type": "web_search"}]}, "tools[0]"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 1.5},
     "seed"),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": True}, "n"),
])
def test_what_cannot_be_served_is_refused_naming_the_field(
    kind: Any, body: dict[str, Any], param: str,
) -> None:
    with pytest.raises(InvalidParam) as excinfo:
        parse_call(kind, body, TENANT, limits=LIMITS)
    assert excinfo.value.param == param


def test_allow_lossy_is_a_kvgate_option_false_unless_sent_as_true() -> None:
    assert chat().request.cache.allow_lossy is False
    assert chat(kvgate={"allow_lossy": None}).request.cache.allow_lossy is False
    assert chat(kvgate={"allow_lossy": False}).request.cache.allow_lossy is False
    lossy = chat(kvgate={"allow_lossy": True, "ttl_s": 50})
    assert lossy.request.cache == CacheOptions(ttl_s=50.0, allow_lossy=True)
    completion = parse_call("completion", {"model": "m", "prompt": "a",
                                           "kvgate": {"allow_lossy": True}},
                            TENANT, limits=LIMITS)
    assert completion.request.cache.allow_lossy is True


@pytest.mark.parametrize("value", ["true", 1, 0, [], {}])
def test_an_allow_lossy_that_is_not_a_json_boolean_is_refused_naming_it(value: Any) -> None:
    with pytest.raises(InvalidParam) as excinfo:
        chat(kvgate={"allow_lossy": value})
    assert excinfo.value.param == "kvgate.allow_lossy"
    assert "true or false" in str(excinfo.value) and repr(value) in str(excinfo.value)
