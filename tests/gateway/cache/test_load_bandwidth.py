"""Each lower tier's load bandwidth, measured at start-up (``gateway.cache.load_bandwidth``).

The promise: the first hit on a disk or Redis tier is judged like every later one -- a tier
measured slower than recomputing is not loaded from, not even once -- and the measurement
leaves nothing behind in the tier.
"""

from __future__ import annotations

from pathlib import Path

import redis
import torch

from gateway.cache.load_bandwidth import measure_load_bandwidths
from tests.gateway.cache.test_honest_state import (
    BLOCK,
    CODEC,
    LAYOUT,
    PROMPT,
    RECOMPUTE_S_PER_TOKEN,
    a_reader_of_a_slow_redis,
    on_a_slow_disk,
    served,
    store_notes,
    tier,
)
from tests.redis_harness import FaultProxy, RedisServer
from tests.tiers.faulty_fs import FaultyFileOps
from tiers.breaker import CircuitBreaker
from tiers.disk import DiskStore
from tiers.hierarchy import REMOTE, TierHierarchy, TierLevel
from tiers.memory import DeviceStore
from tiers.page_pool import PagePool
from tiers.redis_store import RedisStore


def device_and_disk(root: Path) -> TierHierarchy:
    disk = DiskStore(root, CODEC, fsync=False)
    disk.start()
    pool = PagePool(LAYOUT, page_tokens=BLOCK, num_pages=64, device="cpu")
    return TierHierarchy([TierLevel(name="device", store=DeviceStore(pool=pool)),
                          TierLevel(name="disk", store=disk)])


def device_and_redis(url: str) -> TierHierarchy:
    store = RedisStore(CODEC, url=url, socket_timeout_s=2.0, connect_timeout_s=2.0,
                       breaker=CircuitBreaker(reset_after_s=5.0))
    store.start()
    return TierHierarchy([TierLevel(name="device", store=DeviceStore(device="cpu"))],
                         remote=store)


def measured(hierarchy: TierHierarchy, max_blocks: int = 8) -> dict[str, float | None]:
    return {result.tier: result.bytes_per_s for result in measure_load_bandwidths(
        hierarchy, LAYOUT, block_tokens=BLOCK, into_tier="device", max_blocks=max_blocks)}


def test_a_disk_tier_measured_at_start_up_has_its_first_load_figure(tmp_path: Path) -> None:
    hierarchy = device_and_disk(tmp_path / "kv")
    try:
        figure = measured(hierarchy)["disk"]
        assert figure is not None and figure > 0
        assert hierarchy.bandwidth("disk") == figure
    finally:
        hierarchy.close()


def test_the_disk_measurement_leaves_no_block_file_and_no_page_taken(tmp_path: Path) -> None:
    hierarchy = device_and_disk(tmp_path / "kv")
    try:
        measured(hierarchy)
        assert hierarchy.store("disk").stats().num_blocks == 0
        assert not list((tmp_path / "kv").rglob("*.kvb"))
        pool = hierarchy.store("device").pool  # type: ignore[attr-defined]
        assert pool.num_in_use == 0
    finally:
        hierarchy.close()


def test_redis_measured_at_start_up_has_its_first_load_figure_and_keeps_no_key(
    redis_server: RedisServer,
) -> None:
    hierarchy = device_and_redis(redis_server.url)
    try:
        figure = measured(hierarchy)[REMOTE]
        assert figure is not None and figure > 0
        assert hierarchy.bandwidth(REMOTE) == figure
        assert redis.Redis.from_url(redis_server.url).dbsize() == 0
    finally:
        hierarchy.close()


def test_a_redis_that_cannot_be_reached_is_not_measured_and_start_up_goes_on() -> None:
    hierarchy = device_and_redis("redis://127.0.0.1:1/0")
    try:
        results = measure_load_bandwidths(hierarchy, LAYOUT, block_tokens=BLOCK,
                                          into_tier="device", max_blocks=2)
        assert [(r.tier, r.bytes_per_s) for r in results] == [(REMOTE, None)]
        assert "not measured" in results[0].describe()
        assert hierarchy.bandwidth(REMOTE) is None
    finally:
        hierarchy.close()


def test_a_redis_measured_slow_at_start_up_is_not_loaded_from_on_its_first_hit(
    fault_proxy: FaultProxy,
) -> None:
    with a_reader_of_a_slow_redis(fault_proxy) as (reader, reader_tiers):
        measured(reader_tiers, max_blocks=2)
        # Without the measurement its whole chain would be fetched (slowly) to find it slow.
        assert served(reader, PROMPT, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ()
        assert store_notes(reader, REMOTE)["recomputed_instead"] == 1


def test_a_disk_measured_slow_at_start_up_is_not_read_on_its_first_hit(
    tmp_path: Path,
) -> None:
    faulty = FaultyFileOps()
    disk = DiskStore(tmp_path / "kv", CODEC, fileops=faulty, fsync=False)
    disk.start()
    hierarchy = TierHierarchy([TierLevel(name="device", store=DeviceStore(device="cpu")),
                               TierLevel(name="disk", store=disk)])
    try:
        disk_cache = on_a_slow_disk(hierarchy, faulty)
        measured(hierarchy, max_blocks=2)
        # Without the measurement its first block would be read (0.1 s) to find it slow.
        assert served(disk_cache, recompute_s_per_token=RECOMPUTE_S_PER_TOKEN) == ()
        assert tier(disk_cache, "disk").recomputed_instead == 1
    finally:
        hierarchy.close()


def test_the_measurement_reads_blocks_of_the_layout_it_is_given(tmp_path: Path) -> None:
    hierarchy = device_and_disk(tmp_path / "kv")
    try:
        [result] = measure_load_bandwidths(hierarchy, LAYOUT, block_tokens=BLOCK,
                                           into_tier="device", target_bytes=3 * 128)
        assert LAYOUT.block_nbytes(BLOCK) == 128 and LAYOUT.dtype == torch.float32
        assert (result.num_blocks, result.num_bytes) == (3, 3 * 128)
    finally:
        hierarchy.close()
