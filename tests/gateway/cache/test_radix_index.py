"""The radix index: longest match, edge compression, verification by tokens, leaf removal."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cache.radix_index import BlockRecord, BlockSpec, RadixIndex
from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import Namespace, Scope
from policies.base import BlockKey

NS_A = Namespace(digest=b"a" * 32, scope=Scope.of_tenant("a"))
NS_B = Namespace(digest=b"b" * 32, scope=Scope.of_tenant("b"))


def chain_specs(ns: Namespace, blocks: list[int]) -> list[BlockSpec]:
    """Blocks named by one small int each; keys chained like the real fingerprints."""
    specs = []
    parent = b""
    for token in blocks:
        tokens = token.to_bytes(4, "little")
        key = hashlib.blake2b(parent + tokens, key=ns.digest, digest_size=16).digest()
        specs.append(BlockSpec(key=BlockKey(key), tokens=tokens, num_bytes=10))
        parent = key
    return specs


def insert(index: RadixIndex, ns: Namespace, blocks: list[int]) -> list[BlockRecord]:
    records = index.insert(ns, None, chain_specs(ns, blocks), now=0.0, ttl_s=None)
    for r in records:
        r.tier_mask |= 1
    return records


def match_len(index: RadixIndex, ns: Namespace, blocks: list[int]) -> int:
    specs = chain_specs(ns, blocks)
    result = index.match(ns, [s.key for s in specs], [s.tokens for s in specs])
    return len(result.records)


def num_edges(index: RadixIndex, ns: Namespace) -> int:
    tree = index._trees[ns.digest]
    count, stack = 0, list(tree.root.children.values())
    while stack:
        edge = stack.pop()
        count += 1
        stack.extend(edge.children.values())
    return count


def test_empty_index_matches_nothing() -> None:
    assert match_len(RadixIndex(), NS_A, [1, 2, 3]) == 0


def test_longest_prefix_of_an_inserted_chain() -> None:
    index = RadixIndex()
    insert(index, NS_A, [1, 2, 3, 4])
    assert match_len(index, NS_A, [1, 2, 3, 4, 5]) == 4
    assert match_len(index, NS_A, [1, 2, 9]) == 2
    assert match_len(index, NS_A, [9]) == 0


def test_a_run_of_blocks_is_one_edge() -> None:
    index = RadixIndex()
    insert(index, NS_A, list(range(32)))
    assert num_edges(index, NS_A) == 1
    index.check_invariants()


def test_extending_a_leaf_edge_keeps_it_one_edge() -> None:
    index = RadixIndex()
    records = insert(index, NS_A, [1, 2])
    more = chain_specs(NS_A, [1, 2, 3, 4])[2:]
    index.insert(NS_A, records[-1], more, now=0.0, ttl_s=None)
    assert num_edges(index, NS_A) == 1
    index.check_invariants()


def test_diverging_mid_edge_splits_it_into_a_branch() -> None:
    index = RadixIndex()
    insert(index, NS_A, [1, 2, 3, 4])
    insert(index, NS_A, [1, 2, 7, 8])
    assert num_edges(index, NS_A) == 3
    assert match_len(index, NS_A, [1, 2, 3, 4]) == 4
    assert match_len(index, NS_A, [1, 2, 7, 8]) == 4
    index.check_invariants()


def test_reinserting_an_existing_chain_reuses_its_records() -> None:
    index = RadixIndex()
    first = insert(index, NS_A, [1, 2, 3])
    again = index.insert(NS_A, None, chain_specs(NS_A, [1, 2, 3]), now=5.0, ttl_s=None)
    assert [a is b for a, b in zip(first, again, strict=True)] == [True, True, True]
    assert num_edges(index, NS_A) == 1
    assert len(index) == 3


def test_namespaces_never_see_each_other() -> None:
    index = RadixIndex()
    insert(index, NS_A, [1, 2])
    specs_b = chain_specs(NS_B, [1, 2])
    # Even probing with A's keys in B's namespace finds nothing.
    specs_a = chain_specs(NS_A, [1, 2])
    assert index.match(NS_B, [s.key for s in specs_a], [s.tokens for s in specs_a]).records == ()
    assert index.match(NS_B, [s.key for s in specs_b], [s.tokens for s in specs_b]).records == ()


def test_a_key_with_other_tokens_is_a_counted_mismatch_not_a_hit() -> None:
    index = RadixIndex()
    insert(index, NS_A, [1, 2])
    specs = chain_specs(NS_A, [1, 2])
    forged_tokens = [specs[0].tokens, b"\xff\xff\xff\xff"]
    result = index.match(NS_A, [s.key for s in specs], forged_tokens)
    assert len(result.records) == 1
    assert result.num_token_mismatches == 1


def test_a_colliding_key_is_never_linked_into_the_trie() -> None:
    index = RadixIndex()
    insert(index, NS_A, [1, 2])
    specs = chain_specs(NS_A, [1, 2])
    collider = BlockSpec(key=specs[0].key, tokens=b"\x09\x00\x00\x00", num_bytes=10)
    assert index.insert(NS_A, None, [collider], now=0.0, ttl_s=None) == []
    # the same key elsewhere in the chain (under another parent) is refused too
    records = insert(index, NS_A, [5])
    reused_key = BlockSpec(key=specs[1].key, tokens=specs[1].tokens, num_bytes=10)
    assert index.insert(NS_A, records[0], [reused_key], now=0.0, ttl_s=None) == []
    index.check_invariants()


def test_removing_leaves_recompresses_edges() -> None:
    index = RadixIndex()
    insert(index, NS_A, [1, 2, 3])
    branch = insert(index, NS_A, [1, 2, 7])
    assert num_edges(index, NS_A) == 3
    index.remove(branch[-1])
    assert num_edges(index, NS_A) == 1
    assert match_len(index, NS_A, [1, 2, 3]) == 3
    index.check_invariants()


def test_removing_the_last_block_drops_the_namespace() -> None:
    index = RadixIndex()
    (record,) = insert(index, NS_A, [1])
    index.remove(record)
    assert index.namespaces() == []
    assert len(index) == 0


def test_only_leaves_can_be_removed() -> None:
    index = RadixIndex()
    records = insert(index, NS_A, [1, 2])
    with pytest.raises(IndexInvariantError, match="only leaves"):
        index.remove(records[0])


def test_a_referenced_block_cannot_be_removed() -> None:
    index = RadixIndex()
    (record,) = insert(index, NS_A, [1])
    record.refcount = 1
    with pytest.raises(IndexInvariantError, match="in use"):
        index.remove(record)


def test_parent_is_derived_across_edges() -> None:
    index = RadixIndex()
    first = insert(index, NS_A, [1, 2, 3])
    second = insert(index, NS_A, [1, 2, 7])
    assert second[2].parent is first[1]
    assert first[1].parent is first[0]
    assert first[0].parent is None


def test_subtree_lists_everything_under_a_prefix() -> None:
    index = RadixIndex()
    a = insert(index, NS_A, [1, 2, 3])
    b = insert(index, NS_A, [1, 2, 7, 8])
    insert(index, NS_A, [4])
    under = {r.key for r in index.subtree(NS_A, a[1])}
    assert under == {a[1].key, a[2].key, b[2].key, b[3].key}
    assert len(list(index.subtree(NS_A))) == 6
    assert list(index.subtree(NS_B, a[1])) == []


def test_leaves_of_a_tier_ignore_children_held_elsewhere() -> None:
    index = RadixIndex()
    records = insert(index, NS_A, [1, 2, 3])
    records[2].tier_mask = 2  # the last block lives only in tier 2
    assert [r.key for r in index.leaves_of_tier(1)] == [records[1].key]
    assert [r.key for r in index.leaves_of_tier(2)] == [records[2].key]


def test_expiry_is_sliding_and_pinning_suspends_it() -> None:
    index = RadixIndex()
    (record,) = index.insert(NS_A, None, chain_specs(NS_A, [1]), now=10.0, ttl_s=5.0)
    assert not record.is_expired(14.9)
    assert record.is_expired(15.0)
    record.is_pinned = True
    assert not record.is_expired(100.0)


blocks = st.lists(st.integers(0, 3), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(
    inserted=st.lists(blocks, min_size=1, max_size=12),
    queries=st.lists(blocks, min_size=1, max_size=6),
    num_removals=st.integers(0, 20),
)
def test_longest_match_equals_brute_force(
    inserted: list[list[int]], queries: list[list[int]], num_removals: int
) -> None:
    index = RadixIndex()
    for seq in inserted:
        insert(index, NS_A, seq)
    present = {tuple(seq[: i + 1]) for seq in inserted for i in range(len(seq))}
    # remove some leaves, keeping the reference set in step
    for _ in range(num_removals):
        leaf = next((r for r in index.records() if not index.has_children(r)), None)
        if leaf is None:
            break
        path = []
        node: BlockRecord | None = leaf
        while node is not None:
            path.append(int.from_bytes(node.tokens, "little"))
            node = node.parent
        present.discard(tuple(reversed(path)))
        index.remove(leaf)
    index.check_invariants()
    assert len(index) == len(present)
    for query in queries + inserted:
        expected = max((i + 1 for i in range(len(query)) if tuple(query[: i + 1]) in present),
                       default=0)
        assert match_len(index, NS_A, query) == expected
