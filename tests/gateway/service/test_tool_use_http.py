"""Tool definitions and tool use on ``/v1/messages`` (``tool_use`` / ``tool_result`` blocks,
through the ``anthropic`` SDK) and ``/v1/responses`` (``function_call`` /
``function_call_output`` items, through the ``openai`` SDK), rendered by the model's chat
template; and refused where the template does not render them.

Two gateways: ``test_openai_http``'s (its fixtures; the tiny Llama's template renders tools and
tool calls, as Qwen2.5's does) and one whose template reads roles and contents only, as
SmolLM2's does (``PLAIN_CHAT_TEMPLATE``). Blocks are 16 tokens (``BLOCK``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from gateway.config.settings import HttpSettings, ServeConfig
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import LookupRequest
from gateway.engine.models.loading import load_model
from gateway.service.auth import Authenticator
from gateway.service.engine_slot import EngineSlot
from gateway.service.http.server import HttpFront
from tests.gateway.grpc_harness import BLOCK, KEY_A, KEYS, LONG_PROMPT, start_gateway
from tests.gateway.service import test_openai_http
from tests.gateway.service.test_openai_http import MODEL, Stack, unique
from tests.tiny_llama import save_tiny_llama
from tests.tokenizer_fixture import PLAIN_CHAT_TEMPLATE

loaded = test_openai_http.loaded
stack = test_openai_http.stack

QUESTION = "Refund order A-7, which shipped twice to the same address."
ARGUMENTS = {"order": "A-7"}
ANTHROPIC_TOOL = {"name": "refund", "description": "Refund an order.",
                  "input_schema": {"type": "object",
                                   "properties": {"order": {"type": "string"}}}}
RESPONSES_TOOL = {"type": "function", "name": "refund", "description": "Refund an order.",
                  "parameters": ANTHROPIC_TOOL["input_schema"], "strict": False}


def _claude(url: str) -> Any:
    return anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=KEY_A, max_retries=0,
                               timeout=60.0)


def _anthropic_turns(call_id: str = "call_1") -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [{"type": "tool_use", "id": call_id,
                                               "name": "refund", "input": ARGUMENTS}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                          "content": "Refunded 42 EUR."}]}]


def _responses_items(call_id: str = "call_1") -> list[dict[str, Any]]:
    return [{"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call_id, "name": "refund",
             "arguments": json.dumps(ARGUMENTS)},
            {"type": "function_call_output", "call_id": call_id, "output": "Refunded 42 EUR."}]


def _prompt_total(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens
               + usage.cache_creation_input_tokens)


def test_a_tool_conversation_through_messages_runs_and_its_repeat_reads_the_cache(
        stack: Stack) -> None:
    system = unique(LONG_PROMPT)
    with _claude(stack.url) as claude:
        first, second = (claude.messages.create(
            model=MODEL, max_tokens=4, system=system, tools=[ANTHROPIC_TOOL],
            messages=_anthropic_turns()) for _ in range(2))
    assert first.usage.cache_read_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= (
        (_prompt_total(second.usage) - 1) // BLOCK * BLOCK)
    assert second.content[0].type == "text"  # the model's text: never parsed into tool calls


def test_the_tool_result_is_in_the_prompt_the_model_reads(stack: Stack) -> None:
    """The tool's result reaches the prompt (a template that dropped it would give the prompt
    of the conversation without it)."""
    system = unique(LONG_PROMPT)
    with _claude(stack.url) as claude:
        with_result = claude.messages.create(model=MODEL, max_tokens=1, system=system,
                                             tools=[ANTHROPIC_TOOL],
                                             messages=_anthropic_turns())
        turns = _anthropic_turns()
        turns[2]["content"][0]["content"] = "Refunded 42 EUR, and a voucher of 10 EUR."
        longer = claude.messages.create(model=MODEL, max_tokens=1, system=system,
                                        tools=[ANTHROPIC_TOOL], messages=turns)
    assert _prompt_total(longer.usage) > _prompt_total(with_result.usage)


def test_a_tool_conversation_is_the_same_prompt_through_messages_and_responses(
        stack: Stack) -> None:
    system = unique(LONG_PROMPT)
    with _claude(stack.url) as claude:
        message = claude.messages.create(model=MODEL, max_tokens=2, system=system,
                                         tools=[ANTHROPIC_TOOL], messages=_anthropic_turns())
    response = stack.sdk().responses.create(model=MODEL, max_output_tokens=2,
                                            instructions=system, tools=[RESPONSES_TOOL],
                                            input=_responses_items())
    assert response.usage.input_tokens == _prompt_total(message.usage)
    assert response.usage.input_tokens_details.cached_tokens >= (
        (response.usage.input_tokens - 1) // BLOCK * BLOCK)


def test_a_function_call_and_its_output_continue_a_stored_response(stack: Stack) -> None:
    instructions = unique(LONG_PROMPT)
    sdk = stack.sdk()
    first = sdk.responses.create(model=MODEL, max_output_tokens=2, instructions=instructions,
                                 tools=[RESPONSES_TOOL], input=QUESTION)
    later = sdk.responses.create(
        model=MODEL, max_output_tokens=2, instructions=instructions, tools=[RESPONSES_TOOL],
        previous_response_id=first.id, input=_responses_items()[1:])
    assert later.usage.input_tokens > first.usage.input_tokens
    assert later.usage.input_tokens_details.cached_tokens >= (
        first.usage.input_tokens // BLOCK * BLOCK)


def test_a_response_echoes_its_tools_and_tool_choice(stack: Stack) -> None:
    response = stack.sdk().responses.create(model=MODEL, max_output_tokens=2, input=QUESTION,
                                            tools=[RESPONSES_TOOL], tool_choice="auto")
    assert [tool.name for tool in response.tools] == ["refund"]
    assert response.tool_choice == "auto"


def test_a_function_call_output_naming_no_call_is_refused_with_its_param(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        stack.sdk().responses.create(model=MODEL, max_output_tokens=2, input=[
            {"type": "function_call_output", "call_id": "call_9", "output": "done"}])
    body: Any = raised.value.body
    assert body["param"] == "input" and "call_9" in body["message"]


def test_function_call_arguments_that_are_not_a_json_object_are_refused(stack: Stack) -> None:
    items = _responses_items()
    items[1]["arguments"] = "not json"
    with pytest.raises(openai.BadRequestError) as raised:
        stack.sdk().responses.create(model=MODEL, max_output_tokens=2, input=items)
    body: Any = raised.value.body
    assert body["param"] == "input[1].arguments"


# ---- a template that does not render tools -------------------------------------------------


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HttpFront, Any]]:
    """A gateway whose model's template reads roles and contents only."""
    model = load_model(str(save_tiny_llama(tmp_path_factory.mktemp("plain") / MODEL,
                                           chat_template=PLAIN_CHAT_TEMPLATE)))
    engines = EngineSlot()
    running = start_gateway(model, engines=engines)
    front = HttpFront(ServeConfig(host="127.0.0.1", port=0, keys=KEYS, http=HttpSettings(port=0)),
                      Authenticator(KEYS), engines)
    front.start()
    try:
        yield front, running
    finally:
        front.stop(timeout_s=5.0)
        running.stop()


def _nothing_cached(running: Any, system: str) -> bool:
    found = running.engine.lookup(LookupRequest(
        prompt=PromptInput(messages=[{"role": "system", "content": system}],
                           add_generation_prompt=False), scope=Scope.of_tenant("tenant-a")))
    return bool(found.cached_tokens == 0)


def test_tools_on_a_template_that_ignores_them_are_refused_on_messages(
        plain: tuple[HttpFront, Any]) -> None:
    front, running = plain
    system = unique(LONG_PROMPT)
    with _claude(front.url) as claude, pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model=MODEL, max_tokens=2, system=system,
                               tools=[ANTHROPIC_TOOL],
                               messages=[{"role": "user", "content": QUESTION}])
    body: Any = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(
        "tools: the chat template of the model 'model' does not render tool definitions")
    assert _nothing_cached(running, system)


def test_tool_use_on_a_template_that_ignores_calls_is_refused_on_messages(
        plain: tuple[HttpFront, Any]) -> None:
    front, _ = plain
    with _claude(front.url) as claude, pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(model=MODEL, max_tokens=2, messages=_anthropic_turns())
    body: Any = raised.value.body
    assert "does not render an assistant's tool calls" in body["error"]["message"]


def test_function_calls_on_a_template_that_ignores_them_are_refused_on_responses(
        plain: tuple[HttpFront, Any]) -> None:
    front, running = plain
    instructions = unique(LONG_PROMPT)
    sdk: Any = openai.OpenAI(base_url=front.url, api_key=KEY_A, max_retries=0, timeout=60.0)
    with sdk, pytest.raises(openai.BadRequestError) as raised:
        sdk.responses.create(model=MODEL, max_output_tokens=2, instructions=instructions,
                             input=_responses_items())
    body: Any = raised.value.body
    assert body["param"] == "input"
    assert "does not render an assistant's tool calls" in body["message"]
    assert _nothing_cached(running, instructions)


def test_a_plain_conversation_on_that_template_is_served(plain: tuple[HttpFront, Any]) -> None:
    front, _ = plain
    with _claude(front.url) as claude:
        message = claude.messages.create(model=MODEL, max_tokens=2,
                                         messages=[{"role": "user", "content": QUESTION}])
    assert message.usage.output_tokens == 2
