"""Tags on cached blocks: a request's tag rides with it to its store step
(``PrefixCache.insert(tag=...)``), which marks its prompt's blocks; ``evict(tag=...)`` drops
them and what follows them, and nothing else.

Same metadata-only cache and fake ``PromptKeys`` as ``test_admin`` (``store`` is a request's
store step); through the engine in ``tests/gateway/engine/test_lossy_engine.py``, over gRPC and
the CLI in ``tests/gateway/cli/test_admin_tags.py``.
"""

from __future__ import annotations

import pytest

from gateway.cache.operations.admin import CacheAdmin, list_prefixes
from gateway.cache.operations.invalidation import EvictionEvent
from gateway.core.errors import InvalidRequest, MalformedEvent
from gateway.core.tags import tag_problem, tag_problems
from tests.gateway.cache.operations.test_admin import (
    ALICE,
    BOB,
    EVENT_BOUNDS,
    KEYS,
    FakeClock,
    make_cache,
    store,
    toks,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_evict_by_tag_drops_the_tagged_prompt_and_keeps_other_tags_and_untagged(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    admin = CacheAdmin(cache, keys=KEYS)
    store(cache, ALICE, toks(1, 2, 3, 4), tag="docs-v3")
    store(cache, ALICE, toks(1, 2, 3, 4), tag="docs-v3")  # again: a tag is kept once
    store(cache, ALICE, toks(5, 6, 7, 8), tag="docs-v2")
    store(cache, ALICE, toks(9, 9, 8, 8))
    store(cache, ALICE, toks(1, 2, 3, 4, 7, 7))  # built on the tagged prompt, untagged itself
    assert {(p.num_blocks, p.tags) for p in list_prefixes(cache)} == {
        (3, ("docs-v3",)), (2, ("docs-v2",)), (2, ())}  # a prompt shows its path's tags

    result = admin.evict(tag="docs-v3")

    assert result.num_blocks == 3
    assert cache.lookup(ALICE, toks(1, 2)).num_blocks == 0
    assert cache.lookup(ALICE, toks(5, 6, 7, 8)).num_blocks == 2
    assert cache.lookup(ALICE, toks(9, 9, 8, 8)).num_blocks == 2


def test_listing_shows_the_tags_of_a_prompts_blocks(clock: FakeClock) -> None:
    cache = make_cache(clock)
    admin = CacheAdmin(cache, keys=KEYS)
    store(cache, ALICE, toks(1, 2), tag="b-tag")
    store(cache, ALICE, toks(1, 2, 3, 4), tag="a-tag")
    [info] = list_prefixes(cache)
    assert info.tags == ("a-tag", "b-tag")
    assert admin.list_prefixes(tenant=None, limit=10)[0].tags == ("a-tag", "b-tag")


def test_a_tag_marks_only_its_own_scopes_blocks_and_tenant_narrows_an_eviction(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    admin = CacheAdmin(cache, keys=KEYS)
    store(cache, ALICE, toks(1, 2), tag="release")
    store(cache, BOB, toks(1, 2))
    assert admin.evict(tag="release", tenant="bob").num_blocks == 0  # bob's copy is untagged
    store(cache, BOB, toks(1, 2), tag="release")
    assert admin.evict(tag="release", tenant="alice").num_blocks == 1
    assert cache.lookup(BOB, toks(1, 2)).num_blocks == 1


def test_an_eviction_by_a_tag_nothing_carries_frees_nothing(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, ALICE, toks(1, 2))
    assert CacheAdmin(cache, keys=KEYS).evict(tag="nothing-here").num_blocks == 0
    assert cache.stats().num_blocks == 1


@pytest.mark.parametrize("tag", ["", "has space", "x" * 65, "tab\t", "ünï", "a/b"])
def test_an_invalid_tag_is_refused_saying_what_a_tag_is(clock: FakeClock, tag: str) -> None:
    admin = CacheAdmin(make_cache(clock), keys=KEYS)
    assert tag_problem(tag) is not None
    with pytest.raises(InvalidRequest, match="letters, digits"):
        admin.evict(tag=tag)
    assert tag_problems(tag, no_cache=False) == [f"tag: {tag_problem(tag)}"]  # what a request
    # naming it is refused with, before it runs (``Engine.generate``, ``Engine.start_warm``)


def test_a_tag_eviction_reaches_another_replica_through_the_event_stream(
    clock: FakeClock,
) -> None:
    event = EvictionEvent(tag="docs-v3", tenant="alice").with_origin("replica-1")
    assert EvictionEvent.from_fields(event.to_fields(), EVENT_BOUNDS) == event
    with pytest.raises(MalformedEvent, match="tag is not a tag"):
        EvictionEvent.from_fields({"kind": "evict", "tag": "no spaces"}, EVENT_BOUNDS)
    cache = make_cache(clock)
    admin = CacheAdmin(cache, keys=KEYS)
    store(cache, ALICE, toks(1, 2), tag="docs-v3")
    store(cache, ALICE, toks(3, 4))
    admin.apply_event(event)
    assert cache.lookup(ALICE, toks(1, 2)).num_blocks == 0
    assert cache.lookup(ALICE, toks(3, 4)).num_blocks == 1
