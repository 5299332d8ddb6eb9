"""Conversation tails: found by the block they continue and the tokens that follow, bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cache.radix_index import BlockRecord, RadixIndex
from gateway.core.fingerprint import Namespace, Scope
from gateway.engine.kv.tail_cache import TailCache
from tests.gateway.cache.test_radix_index import insert
from tiers.payload import KVBlock

NS_A = Namespace(digest=b"a" * 32, scope=Scope.of_tenant("a"))
NS_B = Namespace(digest=b"b" * 32, scope=Scope.of_tenant("b"))
BYTES_PER_TOKEN = 2 * 2 * 4  # K and V, 2 layers, one float32 each


def kv(num_tokens: int, fill: float = 1.0) -> KVBlock:
    one = [torch.full((1, num_tokens, 1), fill) for _ in range(2)]
    return KVBlock(keys=tuple(one), values=tuple(t.clone() for t in one))


def tokens(*ids: int) -> np.ndarray:
    return np.array(ids, np.uint32)


def parent(ns: Namespace = NS_A, block: int = 1) -> BlockRecord:
    return insert(RadixIndex(), ns, [block])[0]


def test_a_kept_tail_is_found_after_its_block_when_the_tokens_follow() -> None:
    tails, block = TailCache(1 << 20), parent()
    tails.keep(NS_A, block, tokens(7, 8, 9), kv(3, 0.5))
    found = tails.find(NS_A, block, tokens(7, 8, 9, 10, 11), max_tokens=4)
    assert found is not None and found.num_tokens == 3
    assert torch.equal(found.keys[0], kv(3, 0.5).keys[0])


def test_a_tail_whose_tokens_differ_from_what_follows_is_not_found() -> None:
    tails, block = TailCache(1 << 20), parent()
    tails.keep(NS_A, block, tokens(7, 8, 9), kv(3))
    assert tails.find(NS_A, block, tokens(7, 8, 5, 10), max_tokens=3) is None


def test_a_tail_longer_than_allowed_is_not_found() -> None:
    # The request's last prompt token must be computed (its logits are sampled).
    tails, block = TailCache(1 << 20), parent()
    tails.keep(NS_A, block, tokens(7, 8, 9), kv(3))
    assert tails.find(NS_A, block, tokens(7, 8, 9), max_tokens=2) is None


def test_the_longest_tail_that_fits_is_found() -> None:
    tails, block = TailCache(1 << 20), parent()
    tails.keep(NS_A, block, tokens(7), kv(1))
    tails.keep(NS_A, block, tokens(7, 8, 9), kv(3))
    tails.keep(NS_A, block, tokens(7, 8, 9, 10, 11), kv(5))
    found = tails.find(NS_A, block, tokens(7, 8, 9, 10, 12, 13), max_tokens=5)
    assert found is not None and found.num_tokens == 3


def test_another_namespaces_tail_is_never_found() -> None:
    tails, block = TailCache(1 << 20), parent()
    tails.keep(NS_A, block, tokens(7, 8), kv(2))
    assert tails.find(NS_B, block, tokens(7, 8, 9), max_tokens=2) is None


def test_a_tail_of_a_block_that_left_the_index_is_dropped_even_if_the_block_returns() -> None:
    tails, block = TailCache(1 << 20), parent()
    tails.keep(NS_A, block, tokens(7, 8), kv(2))
    stored_again = parent()  # the same key, a new record: the block was evicted meanwhile
    assert stored_again.key == block.key and stored_again is not block
    assert tails.find(NS_A, stored_again, tokens(7, 8, 9), max_tokens=2) is None
    assert tails.counters.num_bytes == 0


def test_the_least_recently_used_tails_leave_to_keep_the_budget() -> None:
    tails = TailCache(10 * BYTES_PER_TOKEN)
    first, second, third = parent(block=1), parent(block=2), parent(block=3)
    tails.keep(NS_A, first, tokens(1, 1, 1, 1), kv(4))
    tails.keep(NS_A, second, tokens(2, 2, 2, 2), kv(4))
    assert tails.find(NS_A, first, tokens(1, 1, 1, 1, 0), max_tokens=4) is not None
    tails.keep(NS_A, third, tokens(3, 3, 3, 3), kv(4))  # the second, least recent, leaves
    assert tails.find(NS_A, second, tokens(2, 2, 2, 2, 0), max_tokens=4) is None
    assert tails.find(NS_A, first, tokens(1, 1, 1, 1, 0), max_tokens=4) is not None
    assert tails.counters.num_bytes == 8 * BYTES_PER_TOKEN


def test_a_tail_larger_than_the_budget_is_not_kept() -> None:
    tails, block = TailCache(2 * BYTES_PER_TOKEN), parent()
    tails.keep(NS_A, block, tokens(7, 8, 9), kv(3))
    assert tails.counters.num_kept == 0 and tails.counters.num_bytes == 0


def test_a_tail_must_hold_the_kv_of_its_tokens() -> None:
    with pytest.raises(ValueError, match="2 tokens with K/V of 3"):
        TailCache(1 << 20).keep(NS_A, parent(), tokens(7, 8), kv(3))


def test_hits_count_the_tokens_they_spared() -> None:
    tails, block = TailCache(1 << 20), parent()
    tails.keep(NS_A, block, tokens(7, 8, 9), kv(3))
    tails.find(NS_A, block, tokens(7, 8, 9, 1), max_tokens=3)
    tails.find(NS_A, block, tokens(6), max_tokens=3)
    counters = tails.counters
    assert (counters.num_hits, counters.num_tokens_served) == (1, 3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.lists(st.integers(0, 2), min_size=1,
                                                      max_size=4)), max_size=12),
       st.integers(0, 2), st.lists(st.integers(0, 2), max_size=6), st.integers(0, 6))
def test_find_agrees_with_a_search_over_every_kept_tail(
        kept: list[tuple[int, list[int]]], which: int, following: list[int],
        max_tokens: int) -> None:
    blocks = [parent(block=i) for i in range(3)]
    tails = TailCache(1 << 20)  # large: nothing leaves
    for block, ids in kept:
        tails.keep(NS_A, blocks[block], tokens(*ids), kv(len(ids)))
    fitting = [len(ids) for block, ids in kept if block == which and len(ids) <= max_tokens
               and ids == following[:len(ids)]]
    found = tails.find(NS_A, blocks[which], tokens(*following), max_tokens=max_tokens)
    assert (found.num_tokens if found is not None else None) == (max(fitting) if fitting
                                                                 else None)
