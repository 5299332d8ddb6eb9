"""A request's tag rides with it to the step that stores its prompt (issue 48, item 6): the
engine alone marks the blocks, with no admin and no second look at the prompt.

The tag is part of the request (``CacheOptions.tag``, ``WarmRequest.tag``); the engine hands it
to ``PrefixCache.insert`` with the blocks it stores, so nothing tokenises or matches the prompt
again once the request is done. What shows it here: the blocks already carry the tag when the
request's final message arrives, and the engine is the only thing that ever saw the prompt.
The tiny Llama on 16-token blocks over device, host and disk (``tests/gateway/engine/conftest``).
"""

from __future__ import annotations

import pytest

from gateway.cache.operations.admin import evict_where, list_prefixes
from gateway.cache.operations.factory import OpenedCache
from gateway.core.canonical import PromptInput
from gateway.core.errors import InvalidRequest
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, Usage, WarmRequest
from gateway.core.tokens import as_token_ids
from gateway.engine.engine import Engine
from tests.gateway.engine.parity import ALICE, BLOCK

SYSTEM = [(5 * i + 3) % 400 for i in range(2 * BLOCK)]
"""Two full blocks, warmed untagged first: the tagged request finds them cached."""
QUESTION = [(7 * i + 11) % 400 for i in range(BLOCK + 5)]


def tags_by_prompt(opened: OpenedCache) -> dict[int, tuple[str, ...]]:
    """Each cached prompt's tags, by its length in blocks."""
    return {p.num_blocks: p.tags for p in list_prefixes(opened.cache)}


def test_a_tagged_generation_tags_the_blocks_it_found_and_stored_through_the_engine_alone(
        engine: Engine, opened: OpenedCache) -> None:
    engine.warm(WarmRequest(prompt=PromptInput(token_ids=SYSTEM), scope=ALICE))
    handle = engine.generate(GenerateRequest(
        prompt=PromptInput(token_ids=SYSTEM + QUESTION), scope=ALICE,
        sampling=SamplingParams(max_tokens=3), cache=CacheOptions(tag="docs-v3")))
    usages = [event for event in handle if isinstance(event, Usage)]
    # Nothing ran after the request but its own steps: its store step recorded the tag, on
    # the blocks it found (the system prompt's) and on the one it stored.
    assert len(usages) == 1 and usages[0].cached_tokens == 2 * BLOCK
    assert tags_by_prompt(opened) == {3: ("docs-v3",)}
    namespace = engine.namespace(ALICE)
    evict_where(opened.cache, tag="docs-v3")
    assert opened.cache.lookup(namespace, as_token_ids(SYSTEM)).num_blocks == 0


def test_a_tagged_warm_marks_only_its_own_prompt(engine: Engine, opened: OpenedCache) -> None:
    engine.warm(WarmRequest(prompt=PromptInput(token_ids=SYSTEM), scope=ALICE, tag="release"))
    engine.warm(WarmRequest(prompt=PromptInput(token_ids=QUESTION), scope=ALICE))
    assert tags_by_prompt(opened) == {2: ("release",), 1: ()}
    # Warmed again, fully cached (nothing new to store): the tag still reaches its blocks.
    engine.warm(WarmRequest(prompt=PromptInput(token_ids=QUESTION), scope=ALICE, tag="again"))
    assert tags_by_prompt(opened) == {2: ("release",), 1: ("again",)}


@pytest.mark.parametrize(("cache", "match"), [
    (CacheOptions(tag="has space"), "tag: "),
    (CacheOptions(tag="docs-v3", no_cache=True), "no_cache stores none"),
])
def test_a_tag_that_cannot_mark_anything_is_refused_before_the_request_runs(
        engine: Engine, cache: CacheOptions, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        engine.generate(GenerateRequest(prompt=PromptInput(token_ids=SYSTEM), scope=ALICE,
                                        sampling=SamplingParams(max_tokens=1), cache=cache))
    with pytest.raises(InvalidRequest, match="tag: "):
        engine.start_warm(WarmRequest(prompt=PromptInput(token_ids=SYSTEM), scope=ALICE,
                                      tag="has space"))
