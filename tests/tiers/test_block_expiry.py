"""Expiry travels with the block (issue 11, item 1), at the tiers: the header carries it under
the MAC, Redis keys get it as ``PX``, and blocks of the format before it are counted misses.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_harness import RedisServer
from tests.tiers.conftest import (
    TEST_SECRET,
    blocks_equal,
    make_test_codec,
    seeded_block_meta,
    seeded_kv_block,
)
from tests.tiers.format_2 import encode_format_2
from tiers.base import BlockExpiry, BlockMeta, CodecError
from tiers.codec import derive_mac_key
from tiers.disk import DiskStore
from tiers.disk_layout import ShardLayout
from tiers.fileops import RealFileOps
from tiers.redis_store import RedisStore

CODEC = make_test_codec()
MAC_KEY = derive_mac_key(TEST_SECRET)


def with_expiry(seed: int, expiry: BlockExpiry | None) -> BlockMeta:
    return dataclasses.replace(seeded_block_meta(seed), expiry=expiry)


# ---- the header -------------------------------------------------------------------------


@pytest.mark.parametrize("expiry", [
    None,
    BlockExpiry(ttl_s=2.0, expires_at=1_900_000_000.5),
    BlockExpiry(ttl_s=3600.0, expires_at=None),  # pinned when written
])
def test_the_expiry_is_read_back_from_the_authenticated_header(
    expiry: BlockExpiry | None,
) -> None:
    meta = with_expiry(1, expiry)
    blob = CODEC.encode(meta, seeded_kv_block(1))
    assert CODEC.read_header(blob).meta.expiry == expiry
    header, block = CODEC.decode_with_header(blob, seeded_block_meta(1))
    assert header.meta.expiry == expiry and blocks_equal(block, seeded_kv_block(1))


def test_an_expiry_rewritten_without_the_secret_fails_the_mac() -> None:
    blob = bytearray(CODEC.encode(with_expiry(1, BlockExpiry(ttl_s=2.0, expires_at=1.9e9)),
                                  seeded_kv_block(1)))
    ttl_at = 10 + 36 + 16  # prefix, then the fields before the TTL (tiers.block_format)
    blob[ttl_at:ttl_at + 8] = (10**12).to_bytes(8, "little")  # "live for 30 years"
    with pytest.raises(CodecError) as error:
        CODEC.decode(bytes(blob), seeded_block_meta(1))
    assert error.value.reason == "mac"


def test_a_format_2_block_is_refused_as_an_older_version() -> None:
    old = encode_format_2(CODEC, MAC_KEY, seeded_block_meta(1), seeded_kv_block(1))
    for read in (lambda: CODEC.decode(old, seeded_block_meta(1)),
                 lambda: CODEC.read_header(old)):
        with pytest.raises(CodecError) as error:
            read()
        assert error.value.reason == "version"


# ---- old-format blocks in the stores: counted misses, deleted ----------------------------


def write_format_2(root: Path, seed: int) -> Path:
    path = Path(ShardLayout(str(root), RealFileOps(), fsync=False).path_for(
        seeded_block_meta(seed).key))
    path.parent.mkdir(parents=True, exist_ok=True)
    meta, block = seeded_block_meta(seed), seeded_kv_block(seed)
    path.write_bytes(encode_format_2(CODEC, MAC_KEY, meta, block))
    return path


def test_a_format_2_file_found_at_restart_is_counted_and_deleted(tmp_path: Path) -> None:
    path = write_format_2(tmp_path, 1)
    store = DiskStore(tmp_path, CODEC, fsync=False)
    store.start()
    try:
        assert store.take_recovered() == []
        assert not path.exists()
        assert store.stats().verification_failures == {"version": 1}
        assert store.get(seeded_block_meta(1)) is None  # a miss, not an error
    finally:
        store.close()


@pytest.fixture
def redis_store(redis_server: RedisServer) -> Iterator[RedisStore]:
    store = RedisStore(CODEC, url=redis_server.url, ttl_s=60.0)
    store.start()
    yield store
    store.close()


def test_a_format_2_value_in_redis_is_a_counted_miss_and_deleted(
    redis_store: RedisStore, redis_server: RedisServer,
) -> None:
    meta = seeded_block_meta(1)
    redis_server.command("SET", redis_store.redis_key(meta),
                         encode_format_2(CODEC, MAC_KEY, meta, seeded_kv_block(1)))
    assert redis_store.get(meta) is None
    assert redis_store.stats().verification_failures == {"version": 1}
    assert redis_server.command("EXISTS", redis_store.redis_key(meta)) == 0


# ---- Redis: PX from the block's own TTL --------------------------------------------------


def pttl(server: RedisServer, store: RedisStore, meta: BlockMeta) -> int:
    value = server.command("PTTL", store.redis_key(meta))
    assert isinstance(value, int)
    return value


def test_a_block_is_written_to_redis_with_its_own_ttl_capped_by_the_store(
    redis_store: RedisStore, redis_server: RedisServer,
) -> None:
    short = with_expiry(1, BlockExpiry(ttl_s=2.0, expires_at=time.time() + 2.0))
    long = with_expiry(2, BlockExpiry(ttl_s=7200.0, expires_at=time.time() + 7200.0))
    none = with_expiry(3, None)
    redis_store.put_many([(m, seeded_kv_block(i)) for i, m in enumerate((short, long, none), 1)])
    assert 1000 < pttl(redis_server, redis_store, short) <= 2000
    assert 59_000 < pttl(redis_server, redis_store, long) <= 60_000  # the store's cap: 60 s
    assert 59_000 < pttl(redis_server, redis_store, none) <= 60_000


def test_a_block_pinned_when_written_never_expires_in_redis(
    redis_store: RedisStore, redis_server: RedisServer,
) -> None:
    pinned = with_expiry(1, BlockExpiry(ttl_s=2.0, expires_at=None))
    redis_store.put(pinned, seeded_kv_block(1))
    assert pttl(redis_server, redis_store, pinned) == -1
    assert redis_store.get(seeded_block_meta(1)) is not None  # a hit gives it no expiry
    assert pttl(redis_server, redis_store, pinned) == -1


def test_a_fetch_returns_the_header_expiry_and_restarts_the_key_with_that_ttl(
    redis_store: RedisStore, redis_server: RedisServer,
) -> None:
    expiry = BlockExpiry(ttl_s=3.0, expires_at=float(int(time.time()) + 5))  # whole ms
    meta = with_expiry(1, expiry)
    redis_store.put(meta, seeded_kv_block(1))
    redis_server.command("PEXPIRE", redis_store.redis_key(meta), 500)  # nearly gone
    (got,) = redis_store.fetch_chain([seeded_block_meta(1)])
    assert got is not None and got[1] == expiry
    # A hit is a use: the whole TTL again, whatever the header said when it was written.
    assert 2000 < pttl(redis_server, redis_store, meta) <= 3000


def test_refresh_expiry_persists_a_pinned_block_and_restores_an_unpinned_one(
    redis_store: RedisStore, redis_server: RedisServer,
) -> None:
    meta = with_expiry(1, BlockExpiry(ttl_s=5.0, expires_at=time.time() + 5.0))
    redis_store.put(meta, seeded_kv_block(1))
    redis_store.refresh_expiry([with_expiry(1, BlockExpiry(ttl_s=5.0, expires_at=None))])
    assert pttl(redis_server, redis_store, meta) == -1
    redis_store.refresh_expiry([meta])
    assert 4000 < pttl(redis_server, redis_store, meta) <= 5000
