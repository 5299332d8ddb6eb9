"""The whole cache as ``open_cache`` builds it: real model KV through every tier.

KV comes from the tiny random Llama (block-aligned cold prefill), so "bit-identical" here means
what a request would compute. Tiers: device, host, disk (restart reuse) and a real redis-server
shared by two caches, as two replicas would share it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.factory import CacheConfig, OpenedCache, open_cache
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from gateway.engine.models.loading import LoadedModel, compute_block_kv, load_model
from policies.base import BlockKey
from tests.redis_harness import RedisServer
from tests.tiny_llama import save_tiny_llama
from tiers.base import BlockMeta
from tiers.payload import KVBlock

BLOCK = 8
SECRET = b"deployment-secret-for-tests-0001"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def namespace_for(model: LoadedModel, tenant: str = "alice") -> object:
    return derive_namespace(
        NamespaceSpec(
            deployment_secret=SECRET,
            model_fingerprint=model.fingerprint,
            kv_dtype="float32",
            device_kind="cpu",
            scope=Scope.of_tenant(tenant),
        )
    )


def cold_blocks(model: LoadedModel, tokens: TokenIds) -> list[KVBlock]:
    return [
        KVBlock(keys=k, values=v)
        for k, v in compute_block_kv(model, torch.from_numpy(tokens.astype("int64")), BLOCK)
    ]


def identical(a: KVBlock, b: KVBlock) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True)
    )


def serve(opened: OpenedCache, model: LoadedModel, tokens: TokenIds) -> tuple[str, ...]:
    """Load the cached prefix (checking it bit for bit against a cold run), store the rest."""
    cache = opened.cache
    ns = namespace_for(model)
    reference = cold_blocks(model, tokens)
    with cache.acquire(ns, tokens) as lease:  # type: ignore[arg-type]
        loaded = cache.load(lease)
        assert len(loaded) == lease.match.num_blocks
        assert all(identical(a, b) for a, b in zip(loaded, reference, strict=False))
        cache.insert(lease, tier="device", blocks=reference[lease.match.num_blocks:])
        return lease.match.tiers


def prompt(seed: int, num_blocks: int = 3) -> TokenIds:
    g = torch.Generator().manual_seed(seed)
    return as_token_ids(torch.randint(0, 400, (num_blocks * BLOCK + 3,), generator=g).numpy())


def config(tmp_path: Path, **overrides: object) -> CacheConfig:
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4  # tiny Llama: 2 layers, 2 KV heads, head_dim 16
    fields: dict[str, object] = {
        "block_tokens": BLOCK,
        "device_bytes": 3 * block_bytes,
        "host_bytes": 3 * block_bytes,
        "disk_bytes": 100 * block_bytes,
        "disk_path": tmp_path / "disk",
    }
    fields.update(overrides)
    return CacheConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture
def opened(tiny: LoadedModel, tmp_path: Path) -> Iterator[OpenedCache]:
    cache = open_cache(config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    yield cache
    cache.close()


def test_an_engine_on_the_cpu_verifies_block_tags_on_one_thread(opened: OpenedCache) -> None:
    """BLAKE3's threads would take the cores from torch's and spin on them after the hash
    (tiers/block_mac.py): only an engine on a GPU verifies on every core."""
    assert not opened.codec.mac.verifies_on_every_core


def test_kv_is_bit_identical_from_the_device_tier(opened: OpenedCache, tiny: LoadedModel) -> None:
    p = prompt(1)
    assert serve(opened, tiny, p) == ()
    assert serve(opened, tiny, p) == ("device",) * 3


def test_kv_is_bit_identical_after_demotion_to_host(
    opened: OpenedCache, tiny: LoadedModel
) -> None:
    first = prompt(1)
    serve(opened, tiny, first)
    serve(opened, tiny, prompt(2))  # the device tier holds 3 blocks: the first prompt's go down
    opened.hierarchy.flush(timeout_s=10)
    assert serve(opened, tiny, first) == ("host",) * 3
    opened.cache.check_invariants()


def test_kv_is_bit_identical_from_disk_after_host_evicts_it_too(
    opened: OpenedCache, tiny: LoadedModel
) -> None:
    first = prompt(1)
    serve(opened, tiny, first)
    for seed in (2, 3):  # device holds the third prompt, host the second: the first is on disk
        serve(opened, tiny, prompt(seed))
    opened.hierarchy.flush(timeout_s=10)
    assert serve(opened, tiny, first) == ("disk",) * 3
    opened.cache.check_invariants()


def test_a_prefix_cached_before_a_restart_is_a_disk_hit_after_it(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    p = prompt(7)
    first = open_cache(config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    serve(first, tiny, p)
    for seed in range(20, 24):
        serve(first, tiny, prompt(seed))  # everything of p reaches the disk
    first.close()
    second = open_cache(config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    try:
        assert second.num_recovered_blocks >= 3
        assert serve(second, tiny, p) == ("disk",) * 3
    finally:
        second.close()


def test_another_secret_on_the_same_disk_gets_no_hits(tiny: LoadedModel, tmp_path: Path) -> None:
    first = open_cache(config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    for seed in range(30, 34):
        serve(first, tiny, prompt(seed))
    first.close()
    other = open_cache(config(tmp_path), layout=tiny.layout,
                       deployment_secret=b"another-deployment-secret-000002")
    try:
        assert other.num_recovered_blocks == 0
    finally:
        other.close()


@pytest.mark.redis
def test_a_prefix_stored_by_one_replica_is_a_redis_hit_on_another(
    tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer
) -> None:
    p = prompt(11)
    a = open_cache(config(tmp_path / "a", redis_url=redis_server.url, disk_bytes=0),
                   layout=tiny.layout, deployment_secret=SECRET)
    b = open_cache(config(tmp_path / "b", redis_url=redis_server.url, disk_bytes=0),
                   layout=tiny.layout, deployment_secret=SECRET)
    try:
        serve(a, tiny, p)
        assert a.hierarchy.flush(timeout_s=10)
        assert serve(b, tiny, p) == ("redis",) * 3
        assert serve(b, tiny, p) == ("device",) * 3  # now local on b
        assert b.cache.stats().num_remote_hits == 3
    finally:
        a.close()
        b.close()


def chain_metas(opened: OpenedCache, model: LoadedModel, tokens: TokenIds) -> list[BlockMeta]:
    """The identities of ``tokens``' full blocks, as the cache asks its tiers for them."""
    ns = namespace_for(model)
    fp = opened.cache.fingerprinter(ns)  # type: ignore[arg-type]
    keys = fp.block_keys(tokens)
    return [BlockMeta(key=keys[i], parent_key=keys[i - 1] if i else fp.root_parent,
                      namespace_digest=ns.digest, owner=ns.scope.owner,  # type: ignore[attr-defined]
                      tokens=fp.block_token_bytes(tokens, i)) for i in range(len(keys))]


def test_a_run_read_from_disk_is_decoded_into_free_pages_of_the_tier_it_is_meant_for(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4
    opened = open_cache(config(tmp_path, device_bytes=10 * block_bytes),
                        layout=tiny.layout, deployment_secret=SECRET)
    try:
        p = prompt(14)
        serve(opened, tiny, p)
        assert opened.hierarchy.flush(timeout_s=10)
        assert opened.cache.evict("device", 1 << 40) and opened.cache.evict("host", 1 << 40)
        assert opened.hierarchy.flush(timeout_s=10)
        pool = opened.pool
        assert pool is not None and pool.num_in_use == 0
        metas = chain_metas(opened, tiny, p)
        staged = opened.hierarchy.read_many("disk", metas, into_tier="device")
        assert [block is not None and pool.page_of(block) is not None for block in staged] \
            == [True] * 3
        assert all(x is not None and identical(x, y)
                   for x, y in zip(staged, cold_blocks(tiny, p), strict=False))
        plain = opened.hierarchy.read_many("disk", metas)
        assert [block is not None and pool.page_of(block) is None for block in plain] == [True] * 3
    finally:
        opened.close()


def test_a_run_read_from_the_host_tier_is_copied_into_free_pages_with_the_same_bits(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """One copy into the page the device tier keeps, instead of a buffer of the block's own
    copied into a page after it (a lossy host tier's: tests/tiers/test_quantized_host.py)."""
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4
    opened = open_cache(config(tmp_path, device_bytes=10 * block_bytes, disk_bytes=0),
                        layout=tiny.layout, deployment_secret=SECRET)
    try:
        p = prompt(15)
        serve(opened, tiny, p)
        assert opened.cache.evict("device", 1 << 40)
        assert opened.hierarchy.flush(timeout_s=10)
        pool = opened.pool
        assert pool is not None and pool.num_in_use == 0
        metas = chain_metas(opened, tiny, p)
        plain = opened.hierarchy.read_many("host", metas)
        assert all(block is not None and pool.page_of(block) is None for block in plain)
        staged = opened.hierarchy.read_many("host", metas, into_tier="device")
        assert all(block is not None and pool.page_of(block) is not None for block in staged)
        assert all(x is not None and y is not None and identical(x, y)
                   for x, y in zip(staged, plain, strict=True))
        assert all(x is not None and identical(x, y)
                   for x, y in zip(staged, cold_blocks(tiny, p), strict=False))
    finally:
        opened.close()


@pytest.mark.redis
def test_a_chain_from_redis_is_decoded_into_free_pages_of_the_tier_it_is_meant_for(
    tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer
) -> None:
    """On the CPU the device tier keeps such a page as it is: no float buffer of the block's
    own, no copy into a page after it. Blocks not found give their pages back."""
    p = prompt(13)
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4
    a, b = (open_cache(config(tmp_path / name, redis_url=redis_server.url, disk_bytes=0,
                              device_bytes=10 * block_bytes),
                       layout=tiny.layout, deployment_secret=SECRET) for name in ("a", "b"))
    try:
        serve(a, tiny, p)
        assert a.hierarchy.flush(timeout_s=10)
        metas = chain_metas(b, tiny, p)
        missing = BlockMeta(key=BlockKey(b"\x01" * len(metas[0].key)), parent_key=metas[2].key,
                            namespace_digest=metas[0].namespace_digest, owner=metas[0].owner,
                            tokens=metas[0].tokens)
        pool = b.pool
        assert pool is not None
        staged = b.hierarchy.fetch_remote([*metas, missing], into_tier="device")
        assert [pool.page_of(block) is not None for block, _ in staged] == [True] * 3
        assert all(identical(x, y) for (x, _), y in zip(staged, cold_blocks(tiny, p), strict=False))
        assert pool.num_in_use == 3  # the fourth page, for the block not found, went back
        plain = b.hierarchy.fetch_remote(metas)
        assert [pool.page_of(block) for block, _ in plain] == [None] * 3
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_a_dead_redis_degrades_to_misses(
    tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer
) -> None:
    opened = open_cache(config(tmp_path, redis_url=redis_server.url, disk_bytes=0),
                        layout=tiny.layout, deployment_secret=SECRET)
    try:
        redis_server.kill()
        assert serve(opened, tiny, prompt(12)) == ()
        assert serve(opened, tiny, prompt(12)) == ("device",) * 3
    finally:
        opened.close()


def test_invalid_configurations_are_listed_at_once(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as excinfo:
        CacheConfig(block_tokens=0, order="fifo", disk_bytes=10, device_bytes=0)
    message = str(excinfo.value)
    for part in ("block_tokens", "order", "disk_path", "device_bytes"):
        assert part in message


def test_the_page_pool_has_room_for_what_the_disk_write_queue_holds_beside_the_tier_and_requests(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    block_bytes = 2 * 2 * 2 * BLOCK * 16 * 4
    with_queue = open_cache(config(tmp_path / "a", write_queue_bytes=7 * block_bytes),
                            layout=tiny.layout, deployment_secret=SECRET,
                            running_bytes=5 * block_bytes)
    without_disk = open_cache(config(tmp_path / "b", disk_bytes=0),
                              layout=tiny.layout, deployment_secret=SECRET,
                              running_bytes=5 * block_bytes)
    try:
        assert with_queue.pool is not None and without_disk.pool is not None
        assert with_queue.pool.num_pages == 3 + 5 + 7  # device tier + running + the disk queue
        assert without_disk.pool.num_pages == 3 + 5
    finally:
        with_queue.close()
        without_disk.close()

