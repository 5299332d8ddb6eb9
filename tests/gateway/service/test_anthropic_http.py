"""Anthropic's Messages API (``POST /v1/messages``) through the real ``anthropic`` SDK.

The gateway is ``test_openai_http``'s (its ``loaded`` and ``stack`` fixtures: gRPC and HTTP
over one engine, cache and metrics), so the OpenAI and Anthropic routes share one cache, and a
prompt sent through one is a hit through the other. Requests go through ``anthropic.Anthropic``
(retries off); what the SDK will not send goes through ``Stack.raw``. Blocks are 16 tokens
(``BLOCK``), so the prompts below span several.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from gateway.cache.operations.factory import CacheConfig
from gateway.config.settings import HttpSettings, ServeConfig
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import LookupRequest
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.server import HttpFront
from tests.gateway.grpc_harness import (
    BLOCK,
    KEY_A,
    KEY_B,
    KEYS,
    LONG_PROMPT,
    start_gateway,
    wait_until,
)
from tests.gateway.service import test_openai_http
from tests.gateway.service.test_openai_http import MODEL, Stack, unique
from tests.redis_harness import RedisServer

loaded = test_openai_http.loaded
stack = test_openai_http.stack
"""The OpenAI tests' fixtures: a gateway of this module's own, built the same way."""

QUESTION = "How do refunds work for an order that shipped twice to the same address?"


@pytest.fixture(scope="module")
def claude(stack: Stack) -> Iterator[Any]:
    """An SDK client with tenant A's key in ``x-api-key`` (typed ``Any``: the tests send
    fields and blocks the SDK's types do not allow, on purpose)."""
    client = anthropic.Anthropic(base_url=stack.url.removesuffix("/v1"), api_key=KEY_A,
                                 max_retries=0, timeout=60.0)
    try:
        yield client
    finally:
        client.close()


def ask(claude: Any, system: Any, **options: Any) -> Any:
    options.setdefault("max_tokens", 8)
    options.setdefault("messages", [{"role": "user", "content": QUESTION}])
    return claude.messages.create(model=MODEL, system=system, **options)


def marked(text: str, ttl: str | None = None) -> dict[str, Any]:
    """A text block with a cache breakpoint (5 minutes unless ``ttl`` says otherwise)."""
    control: dict[str, str] = {"type": "ephemeral"}
    if ttl is not None:
        control["ttl"] = ttl
    return {"type": "text", "text": text, "cache_control": control}


def prompt_total(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens
               + usage.cache_creation_input_tokens)


def readable(num_tokens: int) -> int:
    """The tokens of a prompt's full blocks a request can read (its last token is always
    computed: a prompt of whole blocks reads all but its last block)."""
    return (num_tokens - 1) // BLOCK * BLOCK


def created(num_tokens: int) -> int:
    """The tokens of a prompt's full blocks, what a cold request stores."""
    return num_tokens // BLOCK * BLOCK


def block_ttls(stack: Stack, messages: list[dict[str, str]]) -> list[float | None]:
    """The TTL of each cached block of the chat ``messages`` in tenant A's scope, in order."""
    engine = stack.engine
    tokens = engine.prompt_tokens(PromptInput(messages=messages))
    namespace = engine.namespace(Scope.of_tenant("tenant-a"))
    opened = stack.running.opened
    assert opened is not None
    cache = opened.cache
    keys = cache.fingerprinter(namespace).block_keys(tokens)
    with cache.placement.locked():
        _, records, _ = cache.match_records(namespace, tokens, keys)
        return [record.ttl_s for record in records]


def cached_tokens(stack: Stack, messages: list[dict[str, str]]) -> int:
    return stack.engine.lookup(LookupRequest(prompt=PromptInput(messages=messages),
                                             scope=Scope.of_tenant("tenant-a"))).cached_tokens


# ---- prompt caching ---------------------------------------------------------------------


def test_second_identical_request_reads_what_the_first_created(claude: Any) -> None:
    system = [marked(unique(LONG_PROMPT))]
    first = ask(claude, system).usage
    second = ask(claude, system).usage
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 0
    assert first.cache_creation.ephemeral_5m_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert first.cache_creation_input_tokens == created(prompt_total(first))
    assert second.cache_read_input_tokens >= readable(prompt_total(second))
    assert prompt_total(second) == prompt_total(first)
    assert second.kvgate["cached_tokens_by_tier"] == {"device": second.cache_read_input_tokens}


def test_second_identical_stream_reads_what_the_first_created(claude: Any) -> None:
    system = [marked(unique(LONG_PROMPT))]

    def streamed() -> Any:
        with claude.messages.stream(model=MODEL, system=system, max_tokens=8,
                                    messages=[{"role": "user", "content": QUESTION}]) as stream:
            return stream.get_final_message().usage

    first, second = streamed(), streamed()
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 0
    assert second.cache_creation_input_tokens == 0
    assert first.cache_creation_input_tokens == created(prompt_total(first))
    assert second.cache_read_input_tokens >= readable(prompt_total(second))
    assert prompt_total(second) == prompt_total(first)


def test_stream_sends_anthropics_event_sequence(stack: Stack) -> None:
    """Read off the wire: the SDK drops ``ping`` events before a caller sees them."""
    system = unique(LONG_PROMPT)
    status, headers, body = stack.raw(
        "POST", "/v1/messages",
        json.dumps({"model": MODEL, "max_tokens": 6, "stream": True,
                    "system": system,
                    "messages": [{"role": "user", "content": QUESTION}]}).encode(),
        {"x-api-key": KEY_A, "anthropic-version": "2023-06-01",
         "content-type": "application/json"})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = []
    for chunk in body.decode().split("\n\n"):
        if chunk:
            name, data = chunk.split("\n")
            payload = json.loads(data.removeprefix("data: "))
            assert name == f"event: {payload['type']}"
            events.append(payload)
    kinds = [event["type"] for event in events]
    num_deltas = kinds.count("content_block_delta")
    assert num_deltas >= 1
    assert kinds == ["message_start", "content_block_start", "ping",
                     *["content_block_delta"] * num_deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start, delta = events[0]["message"], events[-2]
    assert start["id"].startswith("msg_") and start["model"] == MODEL
    assert start["content"] == [] and start["usage"] == {"input_tokens": 0, "output_tokens": 0}
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    usage = delta["usage"]
    assert usage["output_tokens"] >= 1 and usage["cache_read_input_tokens"] == 0
    num_prompt = len(stack.engine.prompt_tokens(PromptInput(messages=[
        {"role": "system", "content": system}, {"role": "user", "content": QUESTION}])))
    assert usage["input_tokens"] + usage["cache_creation_input_tokens"] == num_prompt
    assert usage["cache_creation_input_tokens"] == num_prompt // BLOCK * BLOCK


def test_messages_and_chat_completions_give_the_same_tokens(stack: Stack, claude: Any) -> None:
    system = unique(LONG_PROMPT)
    message = ask(claude, [{"type": "text", "text": system}], max_tokens=12)
    chat = stack.sdk().chat.completions.create(
        model=MODEL, max_tokens=12, messages=[{"role": "system", "content": system},
                                              {"role": "user", "content": QUESTION}])
    assert chat.usage.prompt_tokens == prompt_total(message.usage)
    # The chat read every block the message stored: the same tokens, the same keys.
    assert message.usage.cache_creation_input_tokens == created(chat.usage.prompt_tokens)
    assert chat.usage.prompt_tokens_details.cached_tokens >= readable(chat.usage.prompt_tokens)
    assert chat.choices[0].message.content == "".join(block.text for block in message.content)


def test_messages_responses_and_grpc_read_the_same_blocks(stack: Stack, claude: Any) -> None:
    system = unique(LONG_PROMPT)
    message = ask(claude, system, max_tokens=4)
    response = stack.sdk().responses.create(model=MODEL, instructions=system, input=QUESTION,
                                            max_output_tokens=4, store=False)
    looked = stack.running.client(KEY_A).lookup(messages=[
        {"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    assert response.usage.input_tokens == looked.prompt_tokens == prompt_total(message.usage)
    assert message.usage.cache_creation_input_tokens == created(looked.prompt_tokens) > 0
    assert response.usage.input_tokens_details.cached_tokens >= readable(looked.prompt_tokens)
    assert looked.cached_tokens == created(looked.prompt_tokens)  # a lookup computes nothing


def test_tools_are_the_same_prompt_as_over_chat_completions(stack: Stack, claude: Any) -> None:
    schema = {"type": "object", "properties": {"order": {"type": "string"}}}
    system = unique(LONG_PROMPT)
    message = ask(claude, system, tools=[{"name": "refund", "description": "Refund an order.",
                                          "input_schema": schema}])
    chat = stack.sdk().chat.completions.create(
        model=MODEL, max_tokens=1, tools=[{"type": "function", "function": {
            "name": "refund", "description": "Refund an order.", "parameters": schema}}],
        messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    assert chat.usage.prompt_tokens == prompt_total(message.usage)
    assert message.usage.cache_creation_input_tokens == created(chat.usage.prompt_tokens)
    assert chat.usage.prompt_tokens_details.cached_tokens >= readable(
        chat.usage.prompt_tokens) > 0


def test_5m_breakpoint_blocks_keep_300s_and_1h_blocks_3600s(stack: Stack, claude: Any) -> None:
    system = unique(LONG_PROMPT)
    question = f"{LONG_PROMPT} {QUESTION}"
    usage = ask(claude, [marked(system, "1h")],
                messages=[{"role": "user", "content": [marked(question, "5m")]}]).usage
    ttls = block_ttls(stack, [{"role": "system", "content": system},
                              {"role": "user", "content": question}])
    num_hour = ttls.count(3600.0)
    num_five = ttls.count(300.0)
    assert ttls == [3600.0] * num_hour + [300.0] * num_five  # longer first, nothing else
    assert num_hour >= 2 and num_five >= 2
    assert usage.cache_creation.ephemeral_1h_input_tokens == num_hour * BLOCK
    assert usage.cache_creation.ephemeral_5m_input_tokens == num_five * BLOCK
    assert usage.cache_creation_input_tokens == len(ttls) * BLOCK
    assert usage.cache_read_input_tokens == 0


def test_top_level_cache_control_keeps_the_whole_prompt_for_its_ttl(stack: Stack,
                                                                    claude: Any) -> None:
    system = unique(LONG_PROMPT)
    usage = ask(claude, system, cache_control={"type": "ephemeral", "ttl": "1h"}).usage
    ttls = block_ttls(stack, [{"role": "system", "content": system},
                              {"role": "user", "content": QUESTION}])
    assert len(ttls) >= 3 and set(ttls) == {3600.0}
    assert usage.cache_creation.ephemeral_1h_input_tokens == len(ttls) * BLOCK
    assert usage.cache_creation.ephemeral_5m_input_tokens == 0


def test_unmarked_prompt_is_cached_five_minutes_as_the_hosted_api(stack: Stack,
                                                                  claude: Any) -> None:
    system = unique(LONG_PROMPT)
    usage = ask(claude, system).usage
    ttls = block_ttls(stack, [{"role": "system", "content": system},
                              {"role": "user", "content": QUESTION}])
    assert usage.cache_creation_input_tokens == len(ttls) * BLOCK > 0
    assert usage.cache_creation.ephemeral_5m_input_tokens == len(ttls) * BLOCK
    assert usage.cache_creation.ephemeral_1h_input_tokens == 0
    assert usage.kvgate["cache_creation_ttl_s"] == 300.0
    assert set(ttls) == {300.0}
    # What the refused requests below are checked with sees a stored prompt's system prefix.
    assert cached_tokens(stack, [{"role": "system", "content": system}]) > 0


def test_in_redis_5m_blocks_expire_within_300s_and_1h_blocks_within_3600s(
        loaded: Any, redis_server: RedisServer) -> None:
    """A gateway of its own, with Redis as its shared tier: the TTL travels with the blocks."""
    engines = EngineSlot()
    running = start_gateway(loaded, engines=engines, cache_config=CacheConfig(
        block_tokens=BLOCK, device_bytes=64 << 20, host_bytes=64 << 20,
        redis_url=redis_server.url))
    front = HttpFront(ServeConfig(host="127.0.0.1", port=0, keys=KEYS,
                                  http=HttpSettings(port=0)), Authenticator(KEYS), engines)
    front.start()
    try:
        with anthropic.Anthropic(base_url=front.url.removesuffix("/v1"), api_key=KEY_A,
                                 max_retries=0, timeout=60.0) as client:
            usage = ask(client, [marked(unique(LONG_PROMPT), "1h")], messages=[
                {"role": "user", "content": [marked(f"{LONG_PROMPT} {QUESTION}", "5m")]}]).usage
        num_hour = usage.cache_creation.ephemeral_1h_input_tokens // BLOCK
        num_five = usage.cache_creation.ephemeral_5m_input_tokens // BLOCK
        assert num_hour >= 2 and num_five >= 2
        with redis_server.client() as redis_client:
            def ttls_ms() -> list[int]:
                return sorted(int(redis_client.pttl(key))
                              for key in redis_client.keys("kvgate:*:*"))

            # Written off the request path: wait for the prompt's blocks (and the answer's).
            assert wait_until(lambda: len(ttls_ms()) >= num_hour + num_five, timeout_s=10.0)
            ttls = ttls_ms()
        hours = [ttl for ttl in ttls if ttl > 300_000]
        assert len(hours) == num_hour and all(ttl <= 3_600_000 for ttl in hours), ttls
        assert all(0 < ttl <= 300_000 for ttl in ttls if ttl <= 300_000), ttls
        assert len(ttls) - len(hours) >= num_five, ttls
    finally:
        front.stop(timeout_s=5.0)
        running.stop()


# ---- refused inputs ---------------------------------------------------------------------

BAD_BLOCKS = {
    "unknown_block_type": ([{"type": "hologram", "text": "x"}], "unknown content block type"),
    "image": ([{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                           "data": "iVBORw0KGgo="}}], "images are not supported"),
    "five_breakpoints": ([marked(f"part {i}") for i in range(5)], "at most 4 blocks"),
    "ttl_2h": ([marked("part", "2h")], 'must be "5m" or "1h"'),
}


@pytest.mark.parametrize("case", sorted(BAD_BLOCKS))
def test_bad_input_gets_anthropics_error_and_caches_nothing(stack: Stack, claude: Any,
                                                            case: str) -> None:
    system = unique(LONG_PROMPT)
    blocks, words = BAD_BLOCKS[case]
    with pytest.raises(anthropic.BadRequestError) as raised:
        ask(claude, [marked(system)], messages=[{"role": "user", "content": blocks}])
    assert raised.value.status_code == 400
    body = raised.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"]
    assert cached_tokens(stack, [{"role": "system", "content": system}]) == 0


def test_longer_ttl_after_a_shorter_one_is_refused(claude: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        ask(claude, [marked(unique(LONG_PROMPT), "5m")],
            messages=[{"role": "user", "content": [marked(QUESTION, "1h")]}])
    assert "must come before shorter-lived ones" in raised.value.response.json()["error"][
        "message"]


# ---- keys, versions, errors -------------------------------------------------------------


def test_key_is_taken_from_x_api_key_or_a_bearer_token(stack: Stack) -> None:
    base = stack.url.removesuffix("/v1")
    with anthropic.Anthropic(base_url=base, auth_token=KEY_A, max_retries=0) as bearer:
        answer = bearer.messages.create(model=MODEL, max_tokens=2,
                                        messages=[{"role": "user", "content": "hi"}])
    assert answer.type == "message" and answer.usage.output_tokens >= 1
    status, _, body = stack.raw(
        "POST", "/v1/messages",
        json.dumps({"model": MODEL, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}).encode(),
        {"x-api-key": KEY_A, "anthropic-version": "2023-06-01",
         "content-type": "application/json"})
    assert status == 200 and json.loads(body)["role"] == "assistant"


def test_missing_key_is_anthropics_authentication_error(stack: Stack) -> None:
    status, _, body = stack.raw("POST", "/v1/messages", b"{}",
                                {"anthropic-version": "2023-06-01"})
    assert status == 401
    assert json.loads(body)["type"] == "error"
    assert json.loads(body)["error"]["type"] == "authentication_error"


def test_unknown_model_is_anthropics_not_found_error(claude: Any) -> None:
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="claude-nonexistent", max_tokens=2,
                               messages=[{"role": "user", "content": "hi"}])
    assert raised.value.response.json()["error"]["type"] == "not_found_error"


def test_sampling_fields_and_metadata_are_served(claude: Any) -> None:
    # NOTE: the SDK's create() no longer takes the sampling fields: they go in extra_body.
    answer = claude.messages.create(
        model=MODEL, max_tokens=4, stop_sequences=["\n\n"], metadata={"user_id": "user-17"},
        messages=[{"role": "user", "content": "Count to three."}],
        extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 20})
    assert answer.usage.output_tokens >= 1
    assert answer.stop_reason in ("end_turn", "max_tokens", "stop_sequence")


def _diagnosed(claude: Any, system: str, previous: str | None, **options: Any) -> Any:
    return ask(claude, system, diagnostics={"previous_message_id": previous}, **options)


def test_a_first_turn_with_diagnostics_says_no_miss(claude: Any) -> None:
    message = _diagnosed(claude, unique(LONG_PROMPT), None)
    assert message.diagnostics is not None and message.diagnostics.cache_miss_reason is None


def test_a_request_without_diagnostics_gets_none(claude: Any) -> None:
    assert ask(claude, unique(LONG_PROMPT)).diagnostics is None


def test_a_conversation_that_appends_turns_departs_nowhere(claude: Any) -> None:
    system = unique(LONG_PROMPT)
    first = _diagnosed(claude, system, None)
    second = _diagnosed(claude, system, first.id, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Gladly."},
        {"role": "user", "content": "And the second parcel?"}])
    assert second.diagnostics.cache_miss_reason is None


def test_a_changed_system_prompt_is_system_changed_with_the_tokens_it_missed(
        claude: Any) -> None:
    first = _diagnosed(claude, unique(LONG_PROMPT), None)
    second = _diagnosed(claude, unique(LONG_PROMPT), first.id)
    reason = second.diagnostics.cache_miss_reason
    assert reason.type == "system_changed"
    assert reason.cache_missed_input_tokens == created(prompt_total(first.usage)) > 0


def test_an_edited_earlier_message_is_messages_changed(claude: Any) -> None:
    system = unique(LONG_PROMPT)
    first = _diagnosed(claude, system, None, messages=[
        {"role": "user", "content": f"{LONG_PROMPT} {QUESTION}"}])
    second = _diagnosed(claude, system, first.id, messages=[
        {"role": "user", "content": f"{LONG_PROMPT} Something else entirely."}])
    reason = second.diagnostics.cache_miss_reason
    assert reason.type == "messages_changed"
    assert 0 < reason.cache_missed_input_tokens < created(prompt_total(first.usage))


def test_changed_tools_are_tools_changed(claude: Any) -> None:
    system = unique(LONG_PROMPT)
    schema = {"type": "object", "properties": {}}
    first = _diagnosed(claude, system, None)
    second = _diagnosed(claude, system, first.id, tools=[
        {"name": "refund", "description": "Refund an order.", "input_schema": schema}])
    assert second.diagnostics.cache_miss_reason.type == "tools_changed"


def test_another_name_of_the_served_model_is_no_model_change(stack: Stack, claude: Any) -> None:
    """Every alias is the same model and the same blocks: the served model is compared."""
    system = unique(LONG_PROMPT)
    first = claude.messages.create(  # the served model's other name: its path
        model=stack.engine.model_name, system=system, max_tokens=8,
        messages=[{"role": "user", "content": QUESTION}],
        diagnostics={"previous_message_id": None})
    second = _diagnosed(claude, system, first.id)
    assert second.diagnostics.cache_miss_reason is None


def test_a_changed_tool_result_is_messages_changed(claude: Any) -> None:
    system = unique(LONG_PROMPT)
    schema = {"type": "object", "properties": {}}
    tools = [{"name": "refund", "description": "Refund an order.", "input_schema": schema}]

    def turns(result: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "call_1", "name": "refund", "input": {}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": result}]}]

    first = _diagnosed(claude, system, None, tools=tools, messages=turns("Refunded."))
    second = _diagnosed(claude, system, first.id, tools=tools, messages=turns("Failed."))
    assert second.diagnostics.cache_miss_reason.type == "messages_changed"


def test_an_unknown_or_another_tenants_message_is_not_found(stack: Stack, claude: Any) -> None:
    system = unique(LONG_PROMPT)
    theirs = anthropic.Anthropic(base_url=stack.url.removesuffix("/v1"), api_key=KEY_B,
                                 max_retries=0, timeout=60.0)
    try:
        made = _diagnosed(theirs, system, None)
    finally:
        theirs.close()
    for previous in (made.id, "msg_" + "0" * 24):
        reason = _diagnosed(claude, system, previous).diagnostics.cache_miss_reason
        assert reason.type == "previous_message_not_found"
        assert reason.model_dump(exclude_none=True) == {"type": "previous_message_not_found"}


def test_a_stream_carries_diagnostics_in_message_start(claude: Any) -> None:
    system = unique(LONG_PROMPT)
    first = _diagnosed(claude, system, None)
    with claude.messages.stream(model=MODEL, system=unique(LONG_PROMPT), max_tokens=4,
                                messages=[{"role": "user", "content": QUESTION}],
                                diagnostics={"previous_message_id": first.id}) as stream:
        started = next(event for event in stream if event.type == "message_start")
        stream.until_done()
    assert started.message.diagnostics.cache_miss_reason.type == "system_changed"
