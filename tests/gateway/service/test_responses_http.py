"""OpenAI's Responses API (``POST``, ``GET``, ``DELETE /v1/responses``) through the real
``openai`` SDK, on ``test_openai_http``'s gateway (its fixtures, a gateway of this module's
own). Blocks are 16 tokens (``BLOCK``)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.cache.operations.factory import CacheConfig
from gateway.config.settings import HttpSettings, ServeConfig
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import LookupRequest
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.server import HttpFront
from tests.gateway.grpc_harness import BLOCK, KEY_A, KEY_B, KEYS, LONG_PROMPT, start_gateway
from tests.gateway.service import test_openai_http
from tests.gateway.service.test_openai_http import MODEL, Stack, unique
from tests.redis_harness import RedisServer

loaded = test_openai_http.loaded
stack = test_openai_http.stack
"""The OpenAI tests' fixtures: a gateway of this module's own, built the same way."""


def respond(stack: Stack, key: str = KEY_A, **options: Any) -> Any:
    options.setdefault("max_output_tokens", 6)
    return stack.sdk(key).responses.create(model=MODEL, **options)


def body_of(error: openai.APIStatusError) -> dict[str, Any]:
    """The ``error`` object of a refusal, as the SDK parsed it."""
    assert isinstance(error.body, dict)
    return error.body


def test_a_stored_response_is_retrieved_by_its_tenant(stack: Stack) -> None:
    made = respond(stack, instructions=unique(LONG_PROMPT), input="What is a block?")
    got = stack.sdk().responses.retrieve(made.id)
    assert made.id.startswith("resp_") and got.id == made.id
    assert got.output_text == made.output_text and got.status in ("completed", "incomplete")
    assert got.usage.input_tokens == made.usage.input_tokens


def test_another_tenants_response_id_is_404_and_leaks_nothing(stack: Stack) -> None:
    secret = unique("the launch code is 0000")
    made = respond(stack, input=secret)
    with pytest.raises(openai.NotFoundError) as theirs:
        stack.sdk(KEY_B).responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError) as nobodys:
        stack.sdk(KEY_B).responses.retrieve("resp_" + "0" * 24)
    assert body_of(theirs.value) == {**body_of(nobodys.value),  # the same but for the id
                                     "message": f"No response with id '{made.id}' found."}
    with pytest.raises(openai.NotFoundError) as continued:
        respond(stack, KEY_B, previous_response_id=made.id, input="and then?")
    assert secret not in str(continued.value.body)
    assert body_of(continued.value)["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        stack.sdk(KEY_B).responses.delete(made.id)
    assert stack.sdk().responses.retrieve(made.id).id == made.id  # still tenant A's


def test_three_turns_through_previous_response_id_read_the_first_two_from_cache(
        stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    first = respond(stack, instructions=instructions, input=f"{LONG_PROMPT} First question?")
    second = respond(stack, instructions=instructions, previous_response_id=first.id,
                     input="Second question, a little longer than one word?")
    third = respond(stack, instructions=instructions, previous_response_id=second.id,
                    input="Third?")
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= (
        first.usage.input_tokens // BLOCK * BLOCK)
    assert third.usage.input_tokens_details.cached_tokens >= (
        second.usage.input_tokens // BLOCK * BLOCK)
    assert third.previous_response_id == second.id


def test_a_continued_conversation_is_the_same_prompt_as_sent_whole(stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    first = respond(stack, instructions=instructions, input="One?")
    second = respond(stack, instructions=instructions, previous_response_id=first.id,
                     input="Two?")
    chat = stack.sdk().chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": instructions}, {"role": "user", "content": "One?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two?"}])
    assert chat.usage.prompt_tokens == second.usage.input_tokens
    # It reads every block the second turn stored but the last (a prompt's last token is
    # always computed).
    assert chat.usage.prompt_tokens_details.cached_tokens >= (
        (second.usage.input_tokens - 1) // BLOCK * BLOCK)


def test_a_response_not_stored_cannot_be_retrieved_or_continued(stack: Stack) -> None:
    made = respond(stack, input="Forget this.", store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        stack.sdk().responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        respond(stack, previous_response_id=made.id, input="and then?")


def test_deleting_a_response_forgets_it(stack: Stack) -> None:
    made = respond(stack, input="Keep this a moment.")
    status, _, body = stack.raw("DELETE", f"/v1/responses/{made.id}",
                                headers={"Authorization": f"Bearer {KEY_A}"})
    assert status == 200
    assert json.loads(body) == {"id": made.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        stack.sdk().responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        stack.sdk().responses.delete(made.id)


def test_a_stream_sends_the_responses_events_and_is_stored(stack: Stack) -> None:
    events = list(respond(stack, instructions=unique(LONG_PROMPT), input="Stream it.",
                          stream=True))
    kinds = [event.type for event in events]
    num_deltas = kinds.count("response.output_text.delta")
    assert num_deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added",
                     *["response.output_text.delta"] * num_deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    done = events[-1].response
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert done.output_text == text and done.usage.output_tokens >= 1
    assert stack.sdk().responses.retrieve(done.id).output_text == text


def _block_ttls(stack: Stack, instructions: str, text: str) -> tuple[int, set[float | None]]:
    """How many blocks of the conversation the cache holds, and the TTLs they were kept with."""
    engine = stack.engine
    tokens = engine.prompt_tokens(PromptInput(messages=[
        {"role": "system", "content": instructions}, {"role": "user", "content": text}]))
    namespace = engine.namespace(Scope.of_tenant("tenant-a"))
    opened = stack.running.opened
    assert opened is not None
    cache = opened.cache
    with cache.placement.locked():
        _, records, _ = cache.match_records(namespace, tokens,
                                            cache.fingerprinter(namespace).block_keys(tokens))
        return len(records), {record.ttl_s for record in records}


def test_24h_retention_keeps_the_blocks_a_day(stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    made = respond(stack, instructions=instructions, input="Keep it.",
                   prompt_cache_retention="24h")
    num_blocks, ttls = _block_ttls(stack, instructions, "Keep it.")
    assert num_blocks == made.usage.input_tokens // BLOCK and ttls == {86400.0}


def test_in_memory_retention_keeps_the_blocks_five_minutes(stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    made = respond(stack, instructions=instructions, input="Keep it.")
    num_blocks, ttls = _block_ttls(stack, instructions, "Keep it.")
    assert num_blocks == made.usage.input_tokens // BLOCK and ttls == {300.0}


def test_an_image_is_refused_and_nothing_is_cached(stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    with pytest.raises(openai.BadRequestError) as raised:
        respond(stack, instructions=instructions, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    body = body_of(raised.value)
    assert raised.value.status_code == 400 and body["param"] == "input[0].content[1]"
    assert "text-only model" in body["message"]
    looked = stack.engine.lookup(LookupRequest(
        prompt=PromptInput(messages=[{"role": "system", "content": instructions}]),
        scope=Scope.of_tenant("tenant-a")))
    assert looked.cached_tokens == 0


def _compared(stack: Stack, earlier: str, key: str = KEY_A, **options: Any) -> Any:
    return respond(stack, key, extra_body={
        "prompt_cache_options": {"comparison_response_id": earlier}}, **options)


def test_the_same_prompt_compared_with_its_earlier_response_is_a_cache_hit(
        stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    first = respond(stack, instructions=instructions, input="Keep it.")
    again = _compared(stack, first.id, instructions=instructions, input="Keep it.")
    assert again.prompt_cache_diagnostics.type == "cache_hit"


def test_changed_instructions_are_input_changed_with_the_tokens_missed(stack: Stack) -> None:
    first = respond(stack, instructions=unique(LONG_PROMPT), input="Keep it.")
    second = _compared(stack, first.id, instructions=unique(LONG_PROMPT), input="Keep it.")
    diagnostics = second.prompt_cache_diagnostics
    assert diagnostics.type == "cache_miss" and diagnostics.reason == "input_changed"
    reusable = diagnostics.comparison_reusable_tokens
    assert reusable == first.usage.input_tokens // BLOCK * BLOCK > 0
    assert diagnostics.cache_missed_tokens == reusable


def test_a_changed_prompt_cache_key_is_prompt_cache_key_changed(stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    first = respond(stack, instructions=instructions, input="Keep it.", prompt_cache_key="a")
    second = _compared(stack, first.id, instructions=instructions, input="Keep it.",
                       prompt_cache_key="b")
    assert second.prompt_cache_diagnostics.reason == "prompt_cache_key_changed"


def test_another_tenants_or_an_unknown_response_is_not_found(stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    theirs = respond(stack, KEY_B, instructions=instructions, input="Keep it.")
    for earlier in (theirs.id, "resp_" + "0" * 24):
        compared = _compared(stack, earlier, instructions=instructions, input="Keep it.")
        assert compared.prompt_cache_diagnostics.model_dump(exclude_none=True) == {
            "type": "comparison_response_not_found"}


def test_prompt_cache_options_other_than_the_comparison_are_refused(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        respond(stack, input="hi", extra_body={"prompt_cache_options": {"ttl": "12h"}})
    assert body_of(raised.value)["param"] == "prompt_cache_options.ttl"


def test_with_redis_a_conversation_continues_on_another_replica(
        loaded: Any, redis_server: RedisServer) -> None:
    """Two HTTP fronts sharing a Redis (and the deployment secret), as two replicas: a
    response kept through one is read and continued through the other."""
    engines = EngineSlot()
    cache = CacheConfig(block_tokens=BLOCK, device_bytes=64 << 20, host_bytes=64 << 20,
                        redis_url=redis_server.url)
    running = start_gateway(loaded, engines=engines, cache_config=cache)
    config = ServeConfig(host="127.0.0.1", port=0, keys=KEYS, http=HttpSettings(port=0),
                         cache=cache)
    fronts: list[Any] = [HttpFront(config, Authenticator(KEYS), engines,
                                   deployment_secret=b"d" * 32)
              for _ in range(2)]
    try:
        for front in fronts:
            front.start()
        one, other = (openai.OpenAI(base_url=front.url, api_key=KEY_A, max_retries=0,
                                    timeout=60.0) for front in fronts)
        made: Any
        later: Any
        instructions = unique(LONG_PROMPT)
        made = one.responses.create(model=MODEL, instructions=instructions,
                                    input="Remember 7.", max_output_tokens=4)
        assert other.responses.retrieve(made.id).output_text == made.output_text
        later = other.responses.create(model=MODEL, instructions=instructions,
                                       previous_response_id=made.id, input="Which number?",
                                       max_output_tokens=4)
        assert later.usage.input_tokens > made.usage.input_tokens  # the earlier turn in it
        with pytest.raises(openai.NotFoundError):
            openai.OpenAI(base_url=fronts[1].url, api_key=KEY_B, max_retries=0
                          ).responses.retrieve(made.id)
    finally:
        for front in fronts:
            front.stop(timeout_s=5.0)
        running.stop()
