"""The Messages route's records without a server: breakpoints as a cache plan, usage as
Anthropic counts it, errors in its envelope. The route itself, through the SDK:
``test_anthropic_http.py``."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.keys import Principal
from gateway.core.errors import EngineDraining, QueueFull, Unauthenticated
from gateway.core.requests import Usage
from gateway.service.edge import EdgeLimits
from gateway.service.http.anthropic_requests import credentials, parse_messages
from gateway.service.http.anthropic_responses import anthropic_error_answer, usage_object
from gateway.service.http.cache_breakpoints import CachePlan
from gateway.service.http.errors import InvalidParam

PRINCIPAL = Principal(tenant="tenant-a", is_admin=False)
LIMITS = EdgeLimits(max_deadline_s=60.0)


def parse(**body: Any) -> Any:
    body.setdefault("model", "m")
    body.setdefault("max_tokens", 8)
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse_messages(body, PRINCIPAL, limits=LIMITS)


def text(words: str, ttl: str | None = None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": words}
    if ttl is not None:
        block["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return block


def usage(**counts: int) -> Usage:
    return Usage(prompt_tokens=counts["prompt"], cached_tokens=counts["cached"],
                 cached_tokens_by_tier={"device": counts["cached"]} if counts["cached"] else {},
                 completion_tokens=4, ttft_ms=1.0, total_ms=2.0, finish_reason="length",
                 stored_tokens=counts["stored"])


def test_a_1h_breakpoint_before_a_5m_one_warms_the_prompt_cut_after_its_block() -> None:
    call = parse(system=[text("rules", "1h"), text("more rules")],
                 messages=[{"role": "user", "content": [text("question", "5m")]}])
    assert call.caching.ttl == "5m" and call.request.cache.ttl_s == 300.0
    longer = call.caching.longer
    assert longer is not None and longer.add_generation_prompt is False
    assert longer.messages == [{"role": "system", "content": "rules"}]
    assert call.request.prompt.messages == [
        {"role": "system", "content": "rules\nmore rules"},
        {"role": "user", "content": "question"}]


def test_breakpoints_of_one_ttl_store_with_it_and_warm_nothing() -> None:
    call = parse(system=[text("rules", "1h")],
                 cache_control={"type": "ephemeral", "ttl": "1h"})
    assert call.caching == CachePlan(ttl="1h") and call.request.cache.ttl_s == 3600.0


def test_no_breakpoint_keeps_the_blocks_five_minutes_as_the_hosted_api() -> None:
    call = parse(system="rules")
    assert call.caching == CachePlan(ttl="5m") and call.request.cache.ttl_s == 300.0


def test_no_breakpoint_under_a_max_ttl_below_five_minutes_keeps_the_gateways_own_ttl() -> None:
    call = parse_messages({"model": "m", "max_tokens": 8, "system": "rules",
                           "messages": [{"role": "user", "content": "hi"}]}, PRINCIPAL,
                          limits=EdgeLimits(max_deadline_s=60.0, max_ttl_s=120.0))
    assert call.caching == CachePlan() and call.request.cache.ttl_s is None


def test_a_1h_ttl_over_the_gateways_longest_is_refused() -> None:
    with pytest.raises(InvalidParam) as raised:
        parse_messages({"model": "m", "max_tokens": 8, "system": [text("rules", "1h")],
                        "messages": [{"role": "user", "content": "hi"}]}, PRINCIPAL,
                       limits=EdgeLimits(max_deadline_s=60.0, max_ttl_s=600.0))
    assert raised.value.param == "system.0.cache_control.ttl"


def test_a_final_assistant_message_is_refused() -> None:
    with pytest.raises(InvalidParam) as raised:
        parse(messages=[{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "The answer is"}])
    assert raised.value.param == "messages.1"


def test_usage_counts_warmed_tokens_as_created_for_an_hour_not_read() -> None:
    # 16 tokens were cached before, the warm stored 48 (read by the generation, which stored 16
    # more for 5 minutes), 20 were computed and not stored.
    counted = usage_object(usage(prompt=100, cached=64, stored=16), CachePlan(ttl="5m"),
                           warmed_tokens=48)
    assert counted["cache_read_input_tokens"] == 16
    assert counted["cache_creation_input_tokens"] == 64
    assert counted["cache_creation"] == {"ephemeral_5m_input_tokens": 16,
                                         "ephemeral_1h_input_tokens": 48}
    assert counted["input_tokens"] == 20


def test_usage_of_an_unmarked_prompt_splits_nothing_by_ttl() -> None:
    counted = usage_object(usage(prompt=70, cached=0, stored=64), CachePlan())
    assert counted["cache_creation_input_tokens"] == 64 and counted["input_tokens"] == 6
    assert counted["cache_creation"] == {"ephemeral_5m_input_tokens": 0,
                                         "ephemeral_1h_input_tokens": 0}
    kvgate = counted["kvgate"]
    assert isinstance(kvgate, dict) and kvgate["cache_creation_ttl_s"] is None


@pytest.mark.parametrize(("exc", "status", "kind"), [
    (Unauthenticated("no key"), 401, "authentication_error"),
    (InvalidParam("messages", "bad"), 400, "invalid_request_error"),
    (QueueFull("full"), 429, "rate_limit_error"),
    (EngineDraining("draining"), 503, "overloaded_error"),
])
def test_errors_are_anthropics_envelope_with_the_routes_status(exc: Exception, status: int,
                                                               kind: str) -> None:
    answer = anthropic_error_answer(exc, where="/v1/messages", retry_after_s=2)
    assert answer.status == status
    assert answer.body == {"type": "error", "error": {"type": kind, "message": str(exc)}}
    assert ("Retry-After" in answer.headers) is (status in (429, 503))


def test_x_api_key_is_checked_as_a_bearer_token() -> None:
    assert credentials([("x-api-key", "k1"), ("anthropic-version", "2023-06-01")]) == [
        ("authorization", "Bearer k1"), ("anthropic-version", "2023-06-01")]


REFUND = {"name": "refund", "description": "Refund an order.",
          "input_schema": {"type": "object", "properties": {"order": {"type": "string"}}}}


def test_tools_are_the_chat_templates_function_schemas_and_stay_in_a_warmed_cut() -> None:
    call = parse(tools=[REFUND], tool_choice={"type": "auto"},
                 system=[text("rules", "1h")],
                 messages=[{"role": "user", "content": [text("question", "5m")]}])
    schema = {"type": "function", "function": {
        "name": "refund", "description": "Refund an order.",
        "parameters": REFUND["input_schema"]}}
    assert call.request.prompt.tools == [schema]
    assert call.caching.longer is not None and call.caching.longer.tools == [schema]


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{**REFUND, "cache_control": {"type": "ephemeral"}}]}, "tools.0.cache_control"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [REFUND], "tool_choice": {"type": "any"}}, "tool_choice"),
])
def test_what_would_need_a_tool_call_is_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParam) as raised:
        parse(**body)
    assert raised.value.param == param


USE = {"type": "tool_use", "id": "toolu_1", "name": "refund", "input": {"order": "A-7"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Refunded."}


def _turns(*messages: tuple[str, Any]) -> list[dict[str, Any]]:
    return [{"role": role, "content": content} for role, content in messages]


def test_tool_use_is_the_assistants_tool_calls_and_a_result_a_tool_message() -> None:
    call = parse(tools=[REFUND], messages=_turns(
        ("user", "Refund A-7."), ("assistant", [text("On it."), USE]),
        ("user", [RESULT, text("Thanks; and A-8?")])))
    assert call.request.prompt.messages == [
        {"role": "user", "content": "Refund A-7."},
        {"role": "assistant", "content": "On it.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "refund", "arguments": {"order": "A-7"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "refund", "content": "Refunded."},
        {"role": "user", "content": "Thanks; and A-8?"}]


def test_a_tool_results_text_blocks_are_joined_and_is_error_is_accepted() -> None:
    result = {**RESULT, "content": [text("Failed:"), text("no such order")], "is_error": True}
    call = parse(messages=_turns(("user", "Refund A-7."), ("assistant", [USE]),
                                 ("user", [result])))
    assert call.request.prompt.messages[-1] == {
        "role": "tool", "tool_call_id": "toolu_1", "name": "refund",
        "content": "Failed:\nno such order"}


def test_a_breakpoint_on_a_tool_result_marks_its_tool_message() -> None:
    marked = {**RESULT, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    call = parse(messages=_turns(("user", "Refund A-7."), ("assistant", [USE]),
                                 ("user", [marked, text("And A-8?", "5m")])))
    longer = call.caching.longer
    assert call.caching.ttl == "5m" and longer is not None
    assert longer.messages == call.request.prompt.messages[:3]
    assert longer.messages[-1]["role"] == "tool"


@pytest.mark.parametrize(("messages", "param"), [
    (_turns(("user", [RESULT])), "messages.0.content.0.tool_use_id"),
    (_turns(("user", "Go."), ("assistant", [USE]), ("user", [text("Hm."), RESULT])),
     "messages.2.content.1"),
    (_turns(("user", "Go."), ("assistant", [USE, text("Done.")]), ("user", [RESULT])),
     "messages.1.content.1"),
    (_turns(("user", "Go."), ("assistant", [{**USE, "input": "A-7"}]), ("user", [RESULT])),
     "messages.1.content.0.input"),
    (_turns(("user", [USE])), "messages.0.content.0.type"),
    (_turns(("user", "Go."), ("assistant", [USE, USE]), ("user", [RESULT])),
     "messages.1.content.1.id"),
])
def test_a_tool_block_out_of_its_place_is_refused_by_name(messages: list[dict[str, Any]],
                                                          param: str) -> None:
    with pytest.raises(InvalidParam) as raised:
        parse(messages=messages)
    assert raised.value.param == param
