"""A chain fetched from Redis straight into free pages of a CPU pool, against a reference model.

For any pattern of present, missing and tampered blocks along a chain, ``fetch_remote`` with
``into_tier`` returns the chain's leading run of good blocks, each a page of the pool holding
exactly the bytes that were stored; every other page it took for the fetch is back in the pool
once the caller lets the blocks go. A real redis-server on loopback, the cache as ``open_cache``
builds it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.cache.operations.factory import CacheConfig, OpenedCache, open_cache
from tests.redis_harness import RedisServer
from tests.tiers.conftest import (
    TEST_BLOCK_TOKENS,
    TEST_LAYOUT,
    TEST_SECRET,
    seeded_block_meta,
    seeded_kv_block,
)

BLOCK_BYTES = TEST_LAYOUT.block_nbytes(TEST_BLOCK_TOKENS)
MAX_CHAIN = 8


@pytest.fixture(scope="module")
def opened(module_redis_server: RedisServer,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenedCache]:
    config = CacheConfig(block_tokens=TEST_BLOCK_TOKENS, device_bytes=4 * MAX_CHAIN * BLOCK_BYTES,
                         host_bytes=BLOCK_BYTES, redis_url=module_redis_server.url,
                         redis_key_prefix="into-pages")
    cache = open_cache(config, layout=TEST_LAYOUT, deployment_secret=TEST_SECRET)
    yield cache
    cache.close()


@pytest.fixture(scope="module")
def raw(module_redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(module_redis_server.url)
    yield client
    client.close()


@pytest.mark.redis
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=st.lists(st.sampled_from(["good", "missing", "tampered"]), min_size=1,
                        max_size=MAX_CHAIN),
       seed=st.integers(0, 1 << 30))
def test_the_leading_good_blocks_come_back_as_pages_and_every_other_page_goes_back(
        opened: OpenedCache, raw: redis.Redis, pattern: list[str], seed: int) -> None:
    remote, pool = opened.hierarchy.remote, opened.pool
    assert remote is not None and pool is not None
    raw.flushdb()
    metas = [seeded_block_meta(seed + i) for i in range(len(pattern))]
    blocks = [seeded_kv_block(seed + i) for i in range(len(pattern))]
    remote.put_many([(m, b) for m, b, kind in zip(metas, blocks, pattern, strict=True)
                     if kind != "missing"])
    for meta, kind in zip(metas, pattern, strict=True):
        if kind == "tampered":
            key = remote.redis_key(meta)  # type: ignore[attr-defined]
            stored_blob = raw.get(key)
            assert isinstance(stored_blob, bytes)
            blob = bytearray(stored_blob)
            blob[-1] ^= 1  # the payload's last byte: the block tag no longer matches
            raw.set(key, bytes(blob))
    in_use = pool.num_in_use

    leading_good = next((i for i, kind in enumerate(pattern) if kind != "good"), len(pattern))
    got = [block for block, _ in opened.hierarchy.fetch_remote(metas, into_tier="device")]
    assert len(got) == leading_good
    assert all(pool.page_of(block) is not None for block in got)
    assert all(torch.equal(a, b) for fetched, stored in zip(got, blocks, strict=False)
               for a, b in zip((*fetched.keys, *fetched.values),
                               (*stored.keys, *stored.values), strict=True))
    assert pool.num_in_use == in_use + leading_good
    del got
    assert pool.num_in_use == in_use


@pytest.mark.gpu
@pytest.mark.redis
def test_on_a_gpu_the_chain_comes_back_as_pages_of_the_gpu_pool(
        module_redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> None:
    config = CacheConfig(block_tokens=TEST_BLOCK_TOKENS, device_bytes=4 * MAX_CHAIN * BLOCK_BYTES,
                         host_bytes=BLOCK_BYTES, redis_url=module_redis_server.url,
                         redis_key_prefix="into-gpu-pages")
    opened = open_cache(config, layout=TEST_LAYOUT, deployment_secret=TEST_SECRET,
                        device=torch.device("cuda"))
    try:
        remote, pool = opened.hierarchy.remote, opened.pool
        assert remote is not None and pool is not None and pool.device.type == "cuda"
        metas = [seeded_block_meta(700 + i) for i in range(3)]
        blocks = [seeded_kv_block(700 + i) for i in range(3)]
        remote.put_many(list(zip(metas, blocks, strict=True)))
        got = [block for block, _ in opened.hierarchy.fetch_remote(metas, into_tier="device")]
        assert len(got) == 3 and all(pool.page_of(block) is not None for block in got)
        assert all(torch.equal(a.cpu(), b) for fetched, stored in zip(got, blocks, strict=True)
                   for a, b in zip((*fetched.keys, *fetched.values),
                                   (*stored.keys, *stored.values), strict=True))
    finally:
        opened.close()
