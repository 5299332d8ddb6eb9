"""How long ``POST /v1/responses`` keeps a conversation's blocks and its stored response."""

from __future__ import annotations

from gateway.config.keys import Principal
from gateway.service.edge import EdgeLimits
from gateway.service.http.responses_requests import parse_responses

PRINCIPAL = Principal(tenant="tenant-a", is_admin=False)
LIMITS = EdgeLimits(max_deadline_s=60.0)


def _body(**fields: object) -> dict[str, object]:
    return {"model": "m", "input": "hi", **fields}


def test_in_memory_retention_keeps_the_blocks_five_minutes_and_the_response_the_stores_ttl(
        ) -> None:
    call = parse_responses(_body(), PRINCIPAL, limits=LIMITS)
    assert call.request.cache.ttl_s == 300.0
    assert call.ttl_s is None  # the response store's own: an idle conversation is not lost


def test_24h_retention_keeps_blocks_and_response_a_day() -> None:
    call = parse_responses(_body(prompt_cache_retention="24h"), PRINCIPAL, limits=LIMITS)
    assert call.request.cache.ttl_s == call.ttl_s == 86400.0


def test_in_memory_retention_under_a_max_ttl_below_five_minutes_keeps_the_gateways_own() -> None:
    call = parse_responses(_body(prompt_cache_retention="in-memory"), PRINCIPAL,
                           limits=EdgeLimits(max_deadline_s=60.0, max_ttl_s=120.0))
    assert call.request.cache.ttl_s is None


def test_a_function_call_joins_the_assistant_message_before_it_and_its_output_names_it(
        ) -> None:
    call = parse_responses(_body(input=[
        {"role": "user", "content": "Refund A-7."},
        {"role": "assistant", "content": "On it."},
        {"type": "function_call", "call_id": "c1", "name": "refund",
         "arguments": '{"order": "A-7"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Refunded."}]),
        PRINCIPAL, limits=LIMITS)
    assert call.request.prompt.messages == [
        {"role": "user", "content": "Refund A-7."},
        {"role": "assistant", "content": "On it.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "refund", "arguments": {"order": "A-7"}}}]},
        {"role": "tool", "content": "Refunded.", "tool_call_id": "c1", "name": "refund"}]


def test_function_tools_are_the_chat_templates_schemas_and_are_kept_as_sent() -> None:
    tool = {"type": "function", "name": "refund", "description": "Refund an order.",
            "parameters": {"type": "object"}, "strict": True}
    call = parse_responses(_body(tools=[tool]), PRINCIPAL, limits=LIMITS)
    assert call.request.prompt.tools == [{"type": "function", "function": {
        "name": "refund", "description": "Refund an order.", "parameters": {"type": "object"}}}]
    assert call.tools == (tool,)
