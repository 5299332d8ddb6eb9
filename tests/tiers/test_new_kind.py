"""Adding a tier is one module and one registry line: a small in-memory kind, written here as
its module would be, registered with one line, keeps the store contract, is read from a
``[[cache.tier]]`` table and serves a cache that ``open_cache`` builds over it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from gateway.cache.config import CacheConfig
from gateway.cache.operations.factory import open_cache
from gateway.config.loader import load_serve_config
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import as_token_ids
from tests.tiers.store_contract import StoreCase, StoreContract, open_case
from tiers.accounting import AccountedStore
from tiers.base import BlockMeta, BlockStore
from tiers.kinds.base import TierContext, bytes_problem
from tiers.kinds.device import DeviceTierConfig
from tiers.kinds.registry import TIER_KINDS
from tiers.page_pool import PagedBlock
from tiers.payload import KVBlock, KVLayout

# -- the module a new kind is: its record, its store, its kind -------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ScratchTierConfig:
    """``[[cache.tier]] kind = "scratch"``: blocks cloned into plain CPU tensors."""

    kind: ClassVar[str] = "scratch"
    size_keys: ClassVar[tuple[str, ...]] = ("bytes",)
    path_keys: ClassVar[tuple[str, ...]] = ()

    bytes: int = 1 << 20

    @property
    def budget_bytes(self) -> int:
        return self.bytes

    @property
    def lossy_format(self) -> None:
        return None

    @property
    def write_through(self) -> bool:
        return False

    def problems(self) -> list[str]:
        problem = bytes_problem(self.bytes)
        return [] if problem is None else [problem]


class ScratchStore(AccountedStore[KVBlock]):
    """Only what differs from the accounting base: what it keeps, and how it puts and gets."""

    num_read_into = 0

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        copy = KVBlock(keys=tuple(k.clone() for k in block.keys),
                       values=tuple(v.clone() for v in block.values))
        with self._lock:
            if meta.key not in self._entries:
                self._add(meta.key, copy)
            self._stats.puts += 1

    def get(self, meta: BlockMeta, *, into: KVBlock | None = None) -> KVBlock | None:
        """The block; with ``into`` (a page), copied into it and returned as it: taking
        ``into`` is all it takes for the hierarchy to load it straight into pages."""
        with self._lock:
            block = self._count_lookup(self._entries.get(meta.key))
        if block is None or into is None:
            return block
        self.num_read_into += 1
        for page, kept in zip((*into.keys, *into.values), (*block.keys, *block.values),
                              strict=True):
            page.copy_(kept)
        return into

    def _entry_bytes(self, entry: KVBlock) -> int:
        return entry.nbytes


class ScratchTier:
    kind = ScratchTierConfig.kind
    tier_name = ScratchTierConfig.kind
    config_type = ScratchTierConfig
    is_remote = False
    may_be_lossy = False
    queues_writes = False
    is_measured = False
    parallel_reads = 1

    def open(self, config: ScratchTierConfig, context: TierContext) -> BlockStore:
        return ScratchStore(name=self.tier_name)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TIER_KINDS, ScratchTier.kind, ScratchTier())  # the registry line


# -- what that buys ----------------------------------------------------------------------------


class TestScratchKind(StoreContract):
    @pytest.fixture
    def case(self, registered: None, tmp_path: Path) -> Iterator[StoreCase]:
        yield from open_case(ScratchTier.kind, tmp_path)


def test_a_tier_table_names_the_new_kind(registered: None, tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[[cache.tier]]\nkind = "device"\n\n[[cache.tier]]\nkind = "scratch"\n'
                    'bytes = "2MiB"\n', encoding="utf-8")
    config = load_serve_config(path, env={}).cache
    assert config.tiers == (DeviceTierConfig(), ScratchTierConfig(bytes=2 << 20))


def test_a_cache_serves_blocks_the_device_tier_gave_down_to_the_new_kind(
        registered: None) -> None:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
    block_bytes = layout.block_nbytes(4)
    config = CacheConfig(block_tokens=4, tiers=(DeviceTierConfig(bytes=2 * block_bytes),
                                                ScratchTierConfig(bytes=16 * block_bytes)))
    opened = open_cache(config, layout=layout, deployment_secret=b"s" * 32)
    namespace = derive_namespace(NamespaceSpec(
        deployment_secret=b"s" * 32, model_fingerprint="tiny", kv_dtype="float32",
        device_kind="cpu", scope=Scope.of_tenant("alice")))
    first, second = (as_token_ids(np.arange(start, start + 9, dtype=np.uint32))
                     for start in (0, 100))
    blocks = [KVBlock.of_packed(torch.randn(1, 2, 1, 4, 4)) for _ in range(2)]
    try:
        cache = opened.cache
        for tokens in (first, second):  # the device tier holds two blocks: the first go down
            with cache.acquire(namespace, tokens) as lease:
                cache.insert(lease, tier="device", blocks=blocks)
        opened.hierarchy.flush(timeout_s=10)
        with cache.acquire(namespace, first) as lease:
            assert lease.match.tiers == ("scratch", "scratch")
            loaded = cache.load(lease)
        assert all(isinstance(got, PagedBlock) for got in loaded)
        store = opened.hierarchy.store("scratch")
        assert isinstance(store, ScratchStore) and store.num_read_into == 2  # into the pages
        assert all(torch.equal(got.keys[0], want.keys[0])
                   and torch.equal(got.values[0], want.values[0])
                   for got, want in zip(loaded, blocks, strict=True))
        assert opened.hierarchy.store("scratch").stats().hits == 2
    finally:
        opened.close()
