"""A pinned block's copy on the tier a restart reads is written again when a write of it
failed (``gateway.cache.operations.sweeper.restore_pinned_copies``, run by every sweep): a
disk full when the pin was set must not leave the pin to die with the process."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.sweeper import restore_pinned_copies
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import as_token_ids
from policies.registry import TierPolicyConfig, build_tier_policy
from tests.tiers.faulty_fs import FaultyFileOps
from tiers.codec import BlockCodec, derive_mac_key
from tiers.disk import DiskStore
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.memory import DeviceStore
from tiers.payload import KVBlock, KVLayout

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
BLOCK = 2
NBYTES = LAYOUT.block_nbytes(BLOCK)
SECRET = b"pinned-copies-test-secret-000001"
NS = derive_namespace(NamespaceSpec(
    deployment_secret=SECRET, model_fingerprint="tiny", kv_dtype="float32",
    device_kind="cpu", scope=Scope.of_tenant("a")))
CODEC = BlockCodec(mac_key=derive_mac_key(SECRET), layout=LAYOUT, block_tokens=BLOCK)
PROMPT = as_token_ids([1, 2, 3, 4, 5])  # two full blocks


def block_for(index: int) -> KVBlock:
    g = torch.Generator().manual_seed(index)
    shape = (LAYOUT.kv_heads, BLOCK, LAYOUT.head_dim)
    return KVBlock(keys=tuple(torch.randn(shape, generator=g) for _ in range(2)),
                   values=tuple(torch.randn(shape, generator=g) for _ in range(2)))


def slot(name: str, *, keeps_pins: bool = False) -> TierSlot:
    policy = build_tier_policy(TierPolicyConfig(budget_bytes=16 * NBYTES))
    return TierSlot(name=name, policy=policy, keeps_pins=keeps_pins)


@pytest.fixture
def faulty() -> FaultyFileOps:
    return FaultyFileOps()


@pytest.fixture
def hierarchy(tmp_path: Path, faulty: FaultyFileOps) -> Iterator[TierHierarchy]:
    disk = DiskStore(tmp_path / "kv", CODEC, fileops=faulty, fsync=False, retry_after_s=0.0)
    disk.start()
    tiers = TierHierarchy([TierLevel(name="device", store=DeviceStore(device="cpu")),
                           TierLevel(name="disk", store=disk)])
    yield tiers
    tiers.close()


@pytest.fixture
def cache(hierarchy: TierHierarchy) -> PrefixCache:
    """Device, then a disk that keeps pins (not written through: only pins reach it)."""
    return PrefixCache(tiers=[slot("device"), slot("disk", keeps_pins=True)],
                       block_tokens=BLOCK, hierarchy=hierarchy)


def store_and_pin(cache: PrefixCache) -> None:
    with cache.acquire(NS, PROMPT) as lease:
        cache.insert(lease, tier="device", blocks=[block_for(i) for i in range(2)])
    assert cache.set_pinned(NS, PROMPT, True) == 2


def disk_copies(cache: PrefixCache, hierarchy: TierHierarchy) -> int:
    """The prompt's blocks the disk holds, by the cache's account and in fact."""
    keys = cache.fingerprinter(NS).block_keys(PROMPT)
    cache.stats()  # failed writes are forgotten here
    placed = sum("disk" in cache.tiers_of(key) for key in keys)
    stored = sum(hierarchy.store("disk").contains(key) for key in keys)
    assert placed == stored
    return stored


def test_a_pinned_block_whose_disk_write_failed_is_written_again_by_the_next_sweep(
    cache: PrefixCache, hierarchy: TierHierarchy, faulty: FaultyFileOps,
) -> None:
    faulty.fail("write", errno.ENOSPC, times=None, path_contains=".kvb")
    store_and_pin(cache)
    assert hierarchy.flush(timeout_s=10.0)
    assert restore_pinned_copies(cache) == 2  # the disk is still full: asked again, failed again
    assert hierarchy.flush(timeout_s=10.0)
    assert disk_copies(cache, hierarchy) == 0
    faulty.clear()
    assert restore_pinned_copies(cache) == 2
    assert hierarchy.flush(timeout_s=10.0)
    assert disk_copies(cache, hierarchy) == 2
    assert restore_pinned_copies(cache) == 0  # on disk now: nothing more to ask for


def test_a_sweep_asks_nothing_of_blocks_that_are_not_pinned(
    cache: PrefixCache, hierarchy: TierHierarchy,
) -> None:
    with cache.acquire(NS, PROMPT) as lease:
        cache.insert(lease, tier="device", blocks=[block_for(i) for i in range(2)])
    assert restore_pinned_copies(cache) == 0
    assert disk_copies(cache, hierarchy) == 0
