"""gRPC ``Lookup`` naming an earlier request (``previous_request_id``): which part of the prompt
changed, the first block that differs and the cached tokens that costs.

The gateway is ``test_openai_http``'s (gRPC and HTTP over one engine and one
``PromptComparisons``, as ``kvgate serve`` builds them), so an id made over HTTP -- a
``/v1/messages`` id through the ``anthropic`` SDK, a ``/v1/responses`` id through the ``openai``
SDK -- can be named over gRPC, through the real client. Blocks are 16 tokens (``BLOCK``).
"""

from __future__ import annotations

import re
from typing import Any

import anthropic
import pytest

from gateway.client import InvalidArgument, KvgateClient
from gateway.core.canonical import PromptInput
from gateway.service.pb import kvgate_pb2 as pb
from gateway.service.pb import kvgate_pb2_grpc as pb_grpc
from tests.gateway.grpc_harness import BLOCK, KEY_A, KEY_B, LONG_PROMPT, metadata
from tests.gateway.service import test_openai_http
from tests.gateway.service.test_openai_http import MODEL, Stack, unique

loaded = test_openai_http.loaded
stack = test_openai_http.stack

ASK = {"role": "user", "content": "How do refunds work for an order that shipped twice?"}
ANSWER = {"role": "assistant", "content": "They are paid back to the card within a week."}
AGAIN = {"role": "user", "content": "And for an order paid with a gift card?"}
TOOL = {"type": "function", "function": {"name": "refund", "description": "Refund an order.",
                                         "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def grpc_a(stack: Stack) -> KvgateClient:
    return stack.running.client(KEY_A)


def _system() -> dict[str, str]:
    return {"role": "system", "content": unique(LONG_PROMPT)}


def _generated(client: KvgateClient, messages: list[dict[str, str]], **options: Any) -> Any:
    _, usage = client.generate_text(messages=messages, max_tokens=2, **options)
    return usage


def _full_blocks(num_tokens: int) -> int:
    return num_tokens // BLOCK * BLOCK


def test_a_generate_of_a_chat_carries_a_request_id(grpc_a: KvgateClient) -> None:
    usage = _generated(grpc_a, [_system(), ASK])
    assert re.fullmatch(r"gen_[0-9a-f]{24}", usage.request_id)


def test_a_generate_of_a_raw_prompt_carries_no_request_id(grpc_a: KvgateClient) -> None:
    _, usage = grpc_a.generate_text(unique(LONG_PROMPT), max_tokens=2)
    assert usage.request_id == ""


def test_a_lookup_without_previous_request_id_has_no_comparison(grpc_a: KvgateClient) -> None:
    assert grpc_a.lookup(messages=[_system(), ASK]).comparison is None


def test_a_prompt_that_only_appends_turns_changed_nothing(grpc_a: KvgateClient) -> None:
    system = _system()
    earlier = _generated(grpc_a, [system, ASK])
    compared = grpc_a.lookup(messages=[system, ASK, ANSWER, AGAIN],
                             previous_request_id=earlier.request_id).comparison
    assert compared is not None and compared.previous_known
    assert compared.changed_part is None and compared.first_differing_block is None
    assert compared.missed_tokens == 0
    assert compared.previous_cached_tokens == _full_blocks(earlier.prompt_tokens) > 0


def test_a_changed_system_prompt_differs_from_block_0_and_misses_every_cached_token(
        grpc_a: KvgateClient) -> None:
    earlier = _generated(grpc_a, [_system(), ASK])
    compared = grpc_a.lookup(messages=[_system(), ASK],
                             previous_request_id=earlier.request_id).comparison
    assert compared is not None and compared.changed_part == "system"
    assert (compared.common_tokens, compared.first_differing_block) == (0, 0)
    assert compared.missed_tokens == compared.previous_cached_tokens > 0


def test_changed_tools_are_the_tools_part(grpc_a: KvgateClient) -> None:
    system = _system()
    earlier = _generated(grpc_a, [system, ASK])
    compared = grpc_a.lookup(messages=[system, ASK], tools=[TOOL],
                             previous_request_id=earlier.request_id).comparison
    assert compared is not None and compared.changed_part == "tools"


def test_an_edited_message_names_its_index_and_the_block_after_the_shared_turns(
        stack: Stack, grpc_a: KvgateClient) -> None:
    system = _system()
    earlier = _generated(grpc_a, [system, ASK, ANSWER, AGAIN])
    edited = {"role": "assistant", "content": "They are not paid back."}
    compared = grpc_a.lookup(messages=[system, ASK, edited, AGAIN],
                             previous_request_id=earlier.request_id).comparison
    assert compared is not None and compared.changed_part == "messages"
    assert compared.first_changed_message == 1
    common = len(stack.engine.prompt_tokens(PromptInput(messages=[system, ASK],
                                                        add_generation_prompt=False)))
    assert compared.common_tokens == common
    before = stack.engine.prompt_tokens(PromptInput(messages=[system, ASK, ANSWER, AGAIN]))
    after = stack.engine.prompt_tokens(PromptInput(messages=[system, ASK, edited, AGAIN]))
    first_token = next(i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b)
    assert compared.first_differing_block == first_token // BLOCK >= common // BLOCK
    assert compared.missed_tokens == (compared.previous_cached_tokens
                                      - compared.first_differing_block * BLOCK)


def test_a_lookup_can_name_an_anthropic_message_id(stack: Stack, grpc_a: KvgateClient) -> None:
    system = unique(LONG_PROMPT)
    claude: Any = anthropic.Anthropic(base_url=stack.url.removesuffix("/v1"), api_key=KEY_A,
                                      max_retries=0, timeout=60.0)
    with claude:
        message = claude.messages.create(model=MODEL, max_tokens=2, system=system,
                                         messages=[ASK], diagnostics={"previous_message_id": None})
    compared = grpc_a.lookup(messages=[{"role": "system", "content": unique(LONG_PROMPT)}, ASK],
                             previous_request_id=message.id).comparison
    assert compared is not None and compared.previous_known
    assert compared.changed_part == "system"


def test_a_lookup_can_name_a_response_id_and_ignores_its_prompt_cache_key(
        stack: Stack, grpc_a: KvgateClient) -> None:
    instructions = unique(LONG_PROMPT)
    response = stack.sdk(KEY_A).responses.create(
        model=MODEL, instructions=instructions, input=ASK["content"], max_output_tokens=2,
        prompt_cache_key="routing-hint")
    compared = grpc_a.lookup(
        messages=[{"role": "system", "content": instructions}, ASK, ANSWER, AGAIN],
        previous_request_id=response.id).comparison
    assert compared is not None and compared.previous_known
    assert compared.changed_part is None and compared.missed_tokens == 0


def test_another_tenants_request_id_is_previous_request_unknown_and_nothing_more(
        stack: Stack) -> None:
    theirs = _generated(stack.running.client(KEY_B), [_system(), ASK])
    stub = pb_grpc.GatewayStub(stack.running.channel())
    answer = stub.Lookup(pb.LookupRequest(
        input=pb.PromptInput(messages=[pb.Message(role="user", content=ASK["content"])]),
        previous_request_id=theirs.request_id), metadata=metadata(KEY_A), timeout=30)
    assert answer.HasField("comparison")
    assert answer.comparison.ListFields() == []  # previous_known false, nothing else set


def test_an_id_nobody_made_is_previous_request_unknown(grpc_a: KvgateClient) -> None:
    compared = grpc_a.lookup(messages=[ASK], previous_request_id="gen_" + "0" * 24).comparison
    assert compared is not None and not compared.previous_known
    assert compared.changed_part is None and compared.previous_cached_tokens == 0


def test_previous_request_id_with_a_raw_prompt_is_invalid_argument(
        grpc_a: KvgateClient) -> None:
    with pytest.raises(InvalidArgument, match="send the prompt as `messages`"):
        grpc_a.lookup("a raw prompt", previous_request_id="gen_" + "0" * 24)


def test_a_malformed_previous_request_id_is_invalid_argument(grpc_a: KvgateClient) -> None:
    with pytest.raises(InvalidArgument, match="previous_request_id must be an id"):
        grpc_a.lookup(messages=[ASK], previous_request_id="../../etc/passwd")

