"""Honest state: what the cache reports and decides is what happened (issue 11, item 4).

Each test states one promise that the code before issue 11 broke: ``ListPrefixes`` age counts
from creation, not from the last use; a hit is a block served to a request, not a match the
engine made for itself; a promotion is counted on the tier the copy went to; a pin stays on
the copies an operator did not evict; and a tier judged slower than recomputing -- a local disk
or the shared Redis -- is probed again, so that it is used once it is fast again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.admin import evict_where, list_prefixes
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.admin_reports import TierReport
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from policies.registry import TierPolicyConfig, build_tier_policy
from tests.redis_harness import FaultProxy
from tests.tiers.faulty_fs import FaultyFileOps
from tiers.breaker import CircuitBreaker
from tiers.codec import BlockCodec, derive_mac_key
from tiers.disk import DiskStore
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore
from tiers.payload import KVBlock, KVLayout
from tiers.redis_store import RedisStore

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
BLOCK = 2
NBYTES = LAYOUT.block_nbytes(BLOCK)
SECRET = b"honest-state-test-secret-0000001"
NS = derive_namespace(NamespaceSpec(
    deployment_secret=SECRET, model_fingerprint="tiny", kv_dtype="float32",
    device_kind="cpu", scope=Scope.of_tenant("a")))
CODEC = BlockCodec(mac_key=derive_mac_key(SECRET), layout=LAYOUT, block_tokens=BLOCK)
PROMPT = as_token_ids([1, 2, 3, 4, 5])  # two full blocks
REPROBE_S = 0.3
RECOMPUTE_S_PER_TOKEN = 0.03
"""60 ms to recompute one 2-token block: slower than a loopback read of 128 bytes (through the
fault proxy on a busy 2-core machine: up to ~25 ms), far faster than a read delayed by 250 ms."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def block_for(index: int) -> KVBlock:
    g = torch.Generator().manual_seed(index)
    shape = (LAYOUT.kv_heads, BLOCK, LAYOUT.head_dim)
    return KVBlock(keys=tuple(torch.randn(shape, generator=g) for _ in range(2)),
                   values=tuple(torch.randn(shape, generator=g) for _ in range(2)))


def slot(name: str, num_blocks: int = 16, clock: FakeClock | None = None,
         write_through: bool = False) -> TierSlot:
    config = TierPolicyConfig(budget_bytes=num_blocks * NBYTES)
    policy = build_tier_policy(config) if clock is None else build_tier_policy(config,
                                                                               clock=clock)
    return TierSlot(name=name, policy=policy, write_through=write_through)


def metadata_cache(clock: FakeClock, names: tuple[str, ...] = ("device",)) -> PrefixCache:
    return PrefixCache(tiers=[slot(n, clock=clock) for n in names], block_tokens=BLOCK,
                       clock=clock)


def stored(cache: PrefixCache, tokens: TokenIds, tier: str = "device") -> None:
    with cache.acquire(NS, tokens) as lease:
        start = lease.match.num_blocks
        if cache.transfers is None:
            cache.insert(lease, tier=tier, block_bytes=NBYTES)
        else:
            cache.insert(lease, tier=tier,
                         blocks=[block_for(i) for i in range(start, len(lease.keys))])


def served(cache: PrefixCache, tokens: TokenIds = PROMPT,
           recompute_s_per_token: float | None = None) -> tuple[str, ...]:
    """What a request does: acquire and load; the tiers its blocks were served from."""
    with cache.acquire(NS, tokens) as lease:
        cache.load(lease, recompute_s_per_token=recompute_s_per_token)
        return lease.match.tiers


def tier(cache: PrefixCache, name: str) -> TierReport:
    return {t.name: t for t in cache.stats().tiers}[name]


def store_notes(cache: PrefixCache, name: str) -> dict[str, int | float | str]:
    return {s.name: s for s in cache.stats().stores}[name].notes


# ---- ages, hits, promotions, pins -------------------------------------------------------


def test_a_prefix_age_counts_from_its_creation_and_its_idle_time_from_its_last_use() -> None:
    clock = FakeClock()
    cache = metadata_cache(clock)
    stored(cache, PROMPT)
    clock.now += 50
    with cache.acquire(NS, PROMPT):  # a use restarts the idle time, not the age
        pass
    clock.now += 10
    (info,) = list_prefixes(cache)
    assert (info.age_s, info.idle_s) == (60.0, 10.0)


def bytes_cache(*, device_blocks: int = 16, host_blocks: int = 16) -> PrefixCache:
    hierarchy = TierHierarchy([
        TierLevel(name="device", store=DeviceStore(device="cpu")),
        TierLevel(name="host", store=HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK,
                                               budget_bytes=host_blocks * NBYTES)),
    ])
    return PrefixCache(tiers=[slot("device", device_blocks), slot("host", host_blocks)],
                       block_tokens=BLOCK, hierarchy=hierarchy)


def test_a_match_the_engine_makes_for_itself_is_not_a_hit() -> None:
    cache = bytes_cache()
    stored(cache, PROMPT)
    with cache.acquire(NS, PROMPT):  # as when storing an answer's blocks: nothing is served
        pass
    assert tier(cache, "device").hits == 0
    assert list_prefixes(cache)[0].num_hits == 0


def test_blocks_served_to_a_request_are_its_hits() -> None:
    cache = bytes_cache()
    stored(cache, PROMPT)
    assert served(cache) == ("device", "device")
    assert tier(cache, "device").hits == 1  # one request served from the device tier
    assert list_prefixes(cache)[0].num_hits == 1


def test_a_promotion_is_counted_on_the_tier_the_copy_went_to() -> None:
    cache = bytes_cache()
    stored(cache, PROMPT)
    cache.evict("device", 10**9)  # demoted to host
    assert served(cache) == ("host", "host")  # ... and promoted back to device on the hit
    assert (tier(cache, "device").promotions, tier(cache, "host").promotions) == (2, 0)
    assert tier(cache, "device").demotions == 2  # moved down from the device tier


def test_evicting_one_tier_copy_keeps_the_pin_on_the_copies_that_stay() -> None:
    clock = FakeClock()
    cache = metadata_cache(clock, ("device", "host"))
    with cache.acquire(NS, PROMPT) as lease:
        cache.insert(lease, tier="device", block_bytes=NBYTES)
    for record in cache.placement.index.records():  # a copy in host as well
        with cache.placement.locked():
            assert cache.placement.place(record, "host")
    assert cache.set_pinned(NS, PROMPT, True) == 2
    evict_where(cache, tier="device")
    (info,) = list_prefixes(cache)
    assert info.tiers == ("host",) and info.is_pinned
    assert cache.evict("host", 10**9).victims == ()  # a pinned copy is never a victim
    evict_where(cache, tier="host")  # the last copy goes: the pin goes with it
    assert list_prefixes(cache) == []


# ---- load or recompute: tiers judged slow are probed again ------------------------------


@pytest.fixture
def faulty() -> FaultyFileOps:
    return FaultyFileOps()


@pytest.fixture
def disk_tiers(tmp_path: Path, faulty: FaultyFileOps) -> Iterator[TierHierarchy]:
    """Device + disk over the fault-injecting file seam."""
    disk = DiskStore(tmp_path / "kv", CODEC, fileops=faulty, fsync=False)
    disk.start()
    hierarchy = TierHierarchy(
        [TierLevel(name="device", store=DeviceStore(device="cpu")),
         TierLevel(name="disk", store=disk)],
        reprobe_interval_s=REPROBE_S)
    yield hierarchy
    hierarchy.close()


def on_disk_only(cache: PrefixCache) -> None:
    cache.evict("device", 10**9)


def on_a_slow_disk(disk_tiers: TierHierarchy, faulty: FaultyFileOps) -> PrefixCache:
    """A cache whose PROMPT is on disk only, each read of it 0.25 s late."""
    disk_cache = PrefixCache(tiers=[slot("device"), slot("disk", write_through=True)],
                             block_tokens=BLOCK, hierarchy=disk_tiers)
    stored(disk_cache, PROMPT)
    assert disk_tiers.flush(timeout_s=10.0)
    on_disk_only(disk_cache)
    faulty.delay("read", 0.25, path_contains=".kvb")
    return disk_cache


def test_a_disk_judged_slow_is_skipped_then_probed_and_used_again_once_fast(
    disk_tiers: TierHierarchy, faulty: FaultyFileOps,
) -> None:
    disk_cache = on_a_slow_disk(disk_tiers, faulty)
    # The first block measures the disk: slower than recomputing, so the second is recomputed.
    assert served(disk_cache, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("disk",)
    on_disk_only(disk_cache)
    # Measured slower than recomputing: the next request recomputes instead of loading.
    assert served(disk_cache, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ()
    assert tier(disk_cache, "disk").recomputed_instead == 2
    faulty.clear()  # the disk is fast again
    assert served(disk_cache, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ()  # not yet
    time.sleep(REPROBE_S + 0.05)
    # One probing load per interval measures it again, and the fresh measurement counts.
    assert served(disk_cache, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("disk", "disk")
    on_disk_only(disk_cache)
    assert served(disk_cache, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("disk", "disk")
    assert store_notes(disk_cache, "disk")["slow_tier_probes"] == 1


def test_a_probe_of_a_disk_still_slow_costs_one_block_not_the_chain(
    disk_tiers: TierHierarchy, faulty: FaultyFileOps,
) -> None:
    disk_cache = on_a_slow_disk(disk_tiers, faulty)
    assert served(disk_cache, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("disk",)
    on_disk_only(disk_cache)
    time.sleep(REPROBE_S + 0.05)
    # The probe reads one block, still slow: the rest is recomputed, not loaded slowly.
    assert served(disk_cache, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("disk",)
    assert store_notes(disk_cache, "disk")["slow_tier_probes"] == 1


def redis_cache(url: str, *, remote_write: bool) -> tuple[PrefixCache, TierHierarchy]:
    store = RedisStore(CODEC, url=url, socket_timeout_s=2.0, connect_timeout_s=2.0,
                       breaker=CircuitBreaker(reset_after_s=0.2))
    store.start()
    hierarchy = TierHierarchy([TierLevel(name="device", store=DeviceStore(device="cpu"))],
                              remote=store, reprobe_interval_s=REPROBE_S)
    hierarchy.start()
    cache = PrefixCache(tiers=[slot("device")], block_tokens=BLOCK, hierarchy=hierarchy,
                        remote_write=remote_write)
    return cache, hierarchy


@contextmanager
def a_reader_of_a_slow_redis(
        fault_proxy: FaultProxy) -> Iterator[tuple[PrefixCache, TierHierarchy]]:
    """A cache (and its tiers) with Redis only below its device tier, where another replica
    stored PROMPT; Redis answers 250 ms late until ``fault_proxy.pass_through()``."""
    writer, writer_tiers = redis_cache(fault_proxy.url, remote_write=True)
    reader, reader_tiers = redis_cache(fault_proxy.url, remote_write=False)
    try:
        stored(writer, PROMPT)
        assert writer_tiers.flush(timeout_s=10.0)
        fault_proxy.delay(250)
        yield reader, reader_tiers
    finally:
        fault_proxy.pass_through()
        writer_tiers.close()
        reader_tiers.close()


def test_the_load_or_recompute_choice_covers_redis_and_probes_it_again(
    fault_proxy: FaultProxy,
) -> None:
    with a_reader_of_a_slow_redis(fault_proxy) as (reader, _):
        assert served(reader, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("redis", "redis")
        reader.evict("device", 10**9)
        # Measured slower than recomputing: the next request does not even ask Redis.
        assert served(reader, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ()
        assert store_notes(reader, "redis")["recomputed_instead"] == 1
        fault_proxy.pass_through()
        time.sleep(REPROBE_S + 0.05)
        assert served(reader, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("redis", "redis")
        reader.evict("device", 10**9)
        assert served(reader, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("redis", "redis")
        assert store_notes(reader, "redis")["slow_tier_probes"] == 1


def test_a_probe_of_a_redis_still_slow_fetches_one_block_not_the_chain(
    fault_proxy: FaultProxy,
) -> None:
    with a_reader_of_a_slow_redis(fault_proxy) as (reader, _):
        assert served(reader, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("redis", "redis")
        reader.evict("device", 10**9)
        assert served(reader, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ()  # judged slow
        time.sleep(REPROBE_S + 0.05)
        # Probed while still slow: one block, the rest recomputed.
        assert served(reader, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ("redis",)
        assert store_notes(reader, "redis")["slow_tier_probes"] == 1

