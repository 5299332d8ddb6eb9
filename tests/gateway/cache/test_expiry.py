"""Expiry travels with the block (issue 11, item 1), in the cache: swept from every tier by a
background sweeper, kept by blocks fetched from Redis and by blocks adopted after a restart,
never for pinned blocks -- in Redis too, and after a restart that pins them again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.adoption import adopt
from gateway.cache.operations.factory import CacheConfig, open_cache
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from policies.registry import TierPolicyConfig, build_tier_policy
from tests.redis_harness import RedisServer
from tiers.base import BlockExpiry, BlockMeta
from tiers.codec import BlockCodec, derive_mac_key
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore
from tiers.payload import KVBlock, KVLayout
from tiers.redis_store import RedisStore

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
BLOCK = 2
NBYTES = LAYOUT.block_nbytes(BLOCK)
SECRET = b"expiry-test-secret-0000000000001"
NS = derive_namespace(NamespaceSpec(
    deployment_secret=SECRET, model_fingerprint="tiny", kv_dtype="float32",
    device_kind="cpu", scope=Scope.of_tenant("a")))
PROMPT = as_token_ids([1, 2, 3, 4, 5])  # two full blocks


class Clocks:
    """A monotonic clock and a wall clock that advance together."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.unix = 1_800_000_000.0

    def mono(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.unix

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.unix += seconds


def block_for(index: int) -> KVBlock:
    g = torch.Generator().manual_seed(index)
    shape = (LAYOUT.kv_heads, BLOCK, LAYOUT.head_dim)
    return KVBlock(keys=tuple(torch.randn(shape, generator=g) for _ in range(2)),
                   values=tuple(torch.randn(shape, generator=g) for _ in range(2)))


def slot(name: str, clocks: Clocks | None = None) -> TierSlot:
    config = TierPolicyConfig(budget_bytes=64 * NBYTES)
    policy = build_tier_policy(config, clock=clocks.mono) if clocks else build_tier_policy(config)
    return TierSlot(name=name, policy=policy)


def store(cache: PrefixCache, tokens: TokenIds = PROMPT, ttl_s: float | None = None) -> None:
    with cache.acquire(NS, tokens) as lease:
        start = lease.match.num_blocks
        cache.insert(lease, tier="device", ttl_s=ttl_s,
                     blocks=[block_for(i) for i in range(start, len(lease.keys))])


def device_host(clocks: Clocks) -> tuple[PrefixCache, TierHierarchy]:
    hierarchy = TierHierarchy([
        TierLevel(name="device", store=DeviceStore(device="cpu")),
        TierLevel(name="host", store=HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK,
                                               budget_bytes=64 * NBYTES)),
    ])
    cache = PrefixCache(tiers=[slot("device", clocks), slot("host", clocks)],
                        block_tokens=BLOCK, hierarchy=hierarchy, clock=clocks.mono,
                        wall_clock=clocks.wall)
    return cache, hierarchy


def test_an_expired_block_leaves_every_tier_and_is_not_demoted(clocks: Clocks) -> None:
    cache, hierarchy = device_host(clocks)
    store(cache, ttl_s=10)
    for record in cache.placement.index.records():  # a copy in host as well
        with cache.placement.locked():
            cache.placement.place(record, "host")
            hierarchy.write("host", cache.placement.meta(record), block_for(0))
    clocks.advance(11)
    assert cache.sweep_expired() == 4  # two blocks, two copies each
    assert cache.stats().num_blocks == 0
    assert [s.num_blocks for s in cache.stats().stores] == [0, 0]
    assert {t.name: t.evictions for t in cache.stats().tiers} == {
        "device": {"ttl": 2}, "host": {"ttl": 2}}


def test_a_pinned_block_never_expires(clocks: Clocks) -> None:
    cache, _ = device_host(clocks)
    store(cache, ttl_s=10)
    cache.set_pinned(NS, PROMPT, True)
    clocks.advance(1000)
    assert cache.sweep_expired() == 0
    assert cache.lookup(NS, PROMPT).num_blocks == 2
    cache.set_pinned(NS, PROMPT, False)  # unpinned: its TTL starts again
    clocks.advance(11)
    assert cache.sweep_expired() == 2 and cache.stats().num_blocks == 0


@pytest.fixture
def clocks() -> Clocks:
    return Clocks()


def test_the_background_sweeper_removes_expired_blocks_with_no_request_meeting_them(
    tmp_path: Path,
) -> None:
    opened = open_cache(CacheConfig(block_tokens=BLOCK, device_bytes=1 << 20, host_bytes=1 << 20,
                                    disk_bytes=1 << 20, disk_path=tmp_path / "kv",
                                    disk_fsync=False, sweep_interval_s=0.1),
                        layout=LAYOUT, deployment_secret=SECRET)
    try:
        # A TTL long enough for the disk write to land first on a slow, loaded machine (at
        # 0.3 s the sweeper once deleted the files before they were looked for).
        store(opened.cache, ttl_s=2.0)
        assert opened.hierarchy.flush(timeout_s=10.0)
        assert list((tmp_path / "kv").rglob("*.kvb"))  # written through to disk
        deadline = time.monotonic() + 10.0
        # The index lets go first; the sweeper deletes the files after the cache's lock.
        while opened.cache.stats().num_blocks or list((tmp_path / "kv").rglob("*.kvb")):
            assert time.monotonic() < deadline, ("the sweeper never removed the expired "
                                                 "blocks from the index and the disk tier")
            time.sleep(0.05)
    finally:
        opened.close()


# ---- restart adoption ---------------------------------------------------------------------


def metadata_cache(clocks: Clocks) -> PrefixCache:
    return PrefixCache(tiers=[slot("disk", clocks)], block_tokens=BLOCK, clock=clocks.mono,
                       wall_clock=clocks.wall)


def found_chain(expiries: list[BlockExpiry | None]) -> list[tuple[BlockMeta, int]]:
    fp = metadata_cache(Clocks()).fingerprinter(NS)
    tokens = as_token_ids(list(range(2 * len(expiries))))
    parent = fp.root_parent
    out = []
    for i, (key, expiry) in enumerate(zip(fp.block_keys(tokens), expiries, strict=True)):
        out.append((BlockMeta(key=key, parent_key=parent, namespace_digest=NS.digest,
                              owner="a", tokens=fp.block_token_bytes(tokens, i),
                              expiry=expiry), NBYTES))
        parent = key
    return out


def test_adopted_blocks_expire_when_their_headers_say(clocks: Clocks) -> None:
    cache = metadata_cache(clocks)
    due = clocks.unix + 30
    found = found_chain([BlockExpiry(ttl_s=60, expires_at=due)] * 2)
    assert adopt(cache, "disk", found) == 2
    clocks.advance(29)
    assert cache.sweep_expired() == 0
    clocks.advance(1)  # 30 s after the restart, not 60
    assert cache.sweep_expired() == 2


def test_a_block_that_expired_while_the_process_was_down_is_not_adopted(clocks: Clocks) -> None:
    cache = metadata_cache(clocks)
    found = found_chain([BlockExpiry(ttl_s=2, expires_at=clocks.unix - 1), None])
    assert adopt(cache, "disk", found) == 0  # nor its child: orphaned
    assert cache.stats().tiers[0].evictions == {"ttl": 1}


def test_a_block_pinned_when_written_is_adopted_with_its_ttl_running_again(
    clocks: Clocks,
) -> None:
    cache = metadata_cache(clocks)
    assert adopt(cache, "disk", found_chain([BlockExpiry(ttl_s=5, expires_at=None)])) == 1
    clocks.advance(6)  # a header alone does not pin: the pin log does (the next test)
    assert cache.sweep_expired() == 1


def test_a_block_the_pin_log_names_is_adopted_pinned_though_its_header_expired(
    clocks: Clocks,
) -> None:
    """Pinned after it was written, the block's header still says when it would have expired
    then; a pin never expires, so the pin log's word wins, and an unpin starts its TTL."""
    cache = metadata_cache(clocks)
    found = found_chain([BlockExpiry(ttl_s=5, expires_at=clocks.unix - 60)])
    assert adopt(cache, "disk", found, pinned={found[0][0].key}) == 1
    clocks.advance(1000)
    assert cache.sweep_expired() == 0
    fp = cache.fingerprinter(NS)
    tokens = as_token_ids(list(range(2)))
    assert cache.set_pinned(NS, tokens, False) == 1 and fp.block_keys(tokens) == [found[0][0].key]
    clocks.advance(6)
    assert cache.sweep_expired() == 1


# ---- Redis --------------------------------------------------------------------------------


@pytest.fixture
def replicas(redis_server: RedisServer, clocks: Clocks,
             ) -> Iterator[tuple[PrefixCache, PrefixCache, RedisStore, TierHierarchy]]:
    """A writing replica and a reading replica on one Redis (the reader on fake clocks)."""
    codec = BlockCodec(mac_key=derive_mac_key(SECRET), layout=LAYOUT, block_tokens=BLOCK)
    hierarchies = []
    caches = []
    for is_writer in (True, False):
        remote = RedisStore(codec, url=redis_server.url, ttl_s=3600.0)
        remote.start()
        hierarchy = TierHierarchy([TierLevel(name="device", store=DeviceStore(device="cpu"))],
                                  remote=remote)
        hierarchy.start()
        hierarchies.append(hierarchy)
        caches.append(PrefixCache(
            tiers=[slot("device", None if is_writer else clocks)], block_tokens=BLOCK,
            hierarchy=hierarchy, remote_write=is_writer,
            clock=time.monotonic if is_writer else clocks.mono,
            wall_clock=time.time if is_writer else clocks.wall))
    yield caches[0], caches[1], remote, hierarchies[0]
    for hierarchy in hierarchies:
        hierarchy.close()


def redis_pttl(server: RedisServer, remote: RedisStore, cache: PrefixCache) -> list[int]:
    metas = [cache.placement.meta(r) for r in cache.placement.index.records()]
    return [int(server.command("PTTL", remote.redis_key(m))) for m in metas]  # type: ignore[call-overload]


def test_a_block_fetched_from_redis_keeps_its_ttl_on_the_replica_that_fetched_it(
    replicas: tuple[PrefixCache, PrefixCache, RedisStore, TierHierarchy], clocks: Clocks,
    redis_server: RedisServer,
) -> None:
    writer, reader, remote, written = replicas
    store(writer, ttl_s=2.0)
    assert written.flush(timeout_s=10.0)
    assert all(0 < t <= 2000 for t in redis_pttl(redis_server, remote, writer))
    with reader.acquire(NS, PROMPT) as lease:
        reader.load(lease)
        assert lease.match.tiers == ("redis", "redis")
    assert [r.ttl_s for r in reader.placement.index.records()] == [2.0, 2.0]
    clocks.advance(2.5)
    assert reader.sweep_expired() == 2 and reader.stats().num_blocks == 0


def test_pinning_reaches_redis_and_unpinning_gives_the_keys_their_ttl_back(
    replicas: tuple[PrefixCache, PrefixCache, RedisStore, TierHierarchy],
    redis_server: RedisServer,
) -> None:
    writer, _, remote, _ = replicas
    store(writer, ttl_s=30.0)
    assert writer.set_pinned(NS, PROMPT, True) == 2
    assert redis_pttl(redis_server, remote, writer) == [-1, -1]
    assert writer.set_pinned(NS, PROMPT, False) == 2
    assert all(25_000 < t <= 30_000 for t in redis_pttl(redis_server, remote, writer))
