"""Restart adoption: whole chains come back, orphans and what does not fit are deleted.

The store is an in-memory one standing in for the disk tier's files; the restart itself (a real
``DiskStore`` over two ``open_cache`` calls) is in ``test_cache_factory.py``.
"""

from __future__ import annotations

import pytest
import torch

from gateway.cache.operations.adoption import adopt
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from policies.base import BlockKey
from policies.registry import TierPolicyConfig, build_tier_policy
from tiers.base import BlockMeta
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.memory import DeviceStore
from tiers.payload import KVBlock, KVLayout

LAYOUT = KVLayout(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)
BLOCK = 2
NBYTES = LAYOUT.block_nbytes(BLOCK)
NS = derive_namespace(NamespaceSpec(deployment_secret=b"k" * 32, model_fingerprint="tiny",
                                    kv_dtype="float32", device_kind="cpu",
                                    scope=Scope.of_tenant("a")))


class RecordingStore(DeviceStore):
    """A device store that remembers what was deleted from it."""

    def __init__(self) -> None:
        super().__init__(device="cpu", name="disk")
        self.deleted: list[BlockKey] = []

    def delete(self, key: BlockKey) -> None:
        self.deleted.append(key)
        super().delete(key)


def payload() -> KVBlock:
    shape = (LAYOUT.kv_heads, BLOCK, LAYOUT.head_dim)
    return KVBlock(keys=(torch.zeros(shape),), values=(torch.ones(shape),))


def chain_metas(cache: PrefixCache, tokens: TokenIds) -> list[BlockMeta]:
    fp = cache.fingerprinter(NS)
    metas = []
    parent = fp.root_parent
    for i, key in enumerate(fp.block_keys(tokens)):
        metas.append(BlockMeta(key=key, parent_key=parent, namespace_digest=NS.digest,
                               owner="a", tokens=fp.block_token_bytes(tokens, i)))
        parent = key
    return metas


def make_cache(budget_blocks: int) -> tuple[PrefixCache, RecordingStore]:
    store = RecordingStore()
    hierarchy = TierHierarchy([TierLevel(name="disk", store=store)])
    slot = TierSlot(name="disk", policy=build_tier_policy(
        TierPolicyConfig(budget_bytes=budget_blocks * NBYTES)))
    return PrefixCache(tiers=[slot], block_tokens=BLOCK, hierarchy=hierarchy), store


def test_whole_chains_are_adopted_and_an_orphan_is_deleted() -> None:
    cache, store = make_cache(budget_blocks=10)
    tokens = as_token_ids([1, 2, 3, 4, 5, 6])
    chain = chain_metas(cache, tokens)
    orphan = chain_metas(cache, as_token_ids([7, 7, 8, 8]))[1]  # its parent did not survive
    for meta in (*chain, orphan):
        store.put(meta, payload())
    found = [(m, NBYTES) for m in reversed([*chain, orphan])]  # order does not matter
    assert adopt(cache, "disk", found) == 3
    assert store.deleted == [orphan.key]
    match = cache.lookup(NS, tokens)
    assert (match.num_blocks, match.tiers) == (3, ("disk",) * 3)
    cache.check_invariants()


def test_what_the_tier_cannot_admit_is_deleted_with_everything_after_it() -> None:
    cache, store = make_cache(budget_blocks=2)
    chain = chain_metas(cache, as_token_ids([1, 2, 3, 4, 5, 6]))
    for meta in chain:
        store.put(meta, payload())
    assert adopt(cache, "disk", [(m, NBYTES) for m in chain]) == 2
    assert store.deleted == [chain[2].key]
    assert cache.stats().num_blocks == 2
    cache.check_invariants()


def test_an_unknown_tier_changes_nothing() -> None:
    cache, _ = make_cache(budget_blocks=2)
    with pytest.raises(ValueError, match="unknown tier"):
        adopt(cache, "tape", [])
