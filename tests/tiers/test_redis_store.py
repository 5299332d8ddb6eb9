"""RedisStore against real redis-server processes (docs/reliability.md group C).

Every test starts its own server (or uses the module's cluster) through the fixtures in
``tests/conftest.py``; faults come from killing processes, from ``FaultProxy`` and from values
written straight into Redis. Timing asserts are functional bounds, orders of magnitude wide.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from policies.base import BlockKey
from tests.redis_harness import FaultProxy, RedisCluster, RedisServer, free_port
from tests.tiers.xxh3_forgery import encode_format_1, forge_keeping_xxh3
from tiers.base import BlockMeta, BlockStore, TierConfigError
from tiers.breaker import CircuitBreaker
from tiers.codec import BlockCodec, DecodedHeader, derive_mac_key
from tiers.payload import KVBlock, KVLayout
from tiers.redis_store import RedisStore, default_max_value_bytes

pytestmark = pytest.mark.redis

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
BLOCK_TOKENS = 4
SECRET = b"deployment-secret-A-0123456789ab"
OTHER_SECRET = b"deployment-secret-B-0123456789ab"
PASSWORD = "hunter2-redis-pass-7f3a"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SpyCodec(BlockCodec):
    """The real codec, counting decode calls."""

    num_decodes = 0

    def decode_with_header(self, data: Any, expected: BlockMeta, *,
                           into: KVBlock | None = None) -> tuple[DecodedHeader, KVBlock]:
        self.num_decodes += 1
        return super().decode_with_header(data, expected, into=into)


def make_codec(
    secret: bytes = SECRET, layout: KVLayout = LAYOUT, codec_class: type[BlockCodec] = BlockCodec
) -> BlockCodec:
    return codec_class(mac_key=derive_mac_key(secret), layout=layout, block_tokens=BLOCK_TOKENS)


def namespace(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=32).digest()


def make_chain(
    ns: bytes, num_blocks: int, *, seed: int = 0, layout: KVLayout = LAYOUT
) -> list[tuple[BlockMeta, KVBlock]]:
    """A chain of blocks with chained keys and random K/V, as the gateway would make."""
    gen = torch.Generator().manual_seed(seed)
    chain = []
    parent = BlockKey(b"\0" * 16)
    for i in range(num_blocks):
        tokens = torch.randint(0, 50_000, (BLOCK_TOKENS,), generator=gen, dtype=torch.int32)
        token_bytes = tokens.numpy().astype("<u4").tobytes()
        key = BlockKey(hashlib.blake2b(parent + token_bytes, key=ns, digest_size=16).digest())
        shape = (layout.kv_heads, BLOCK_TOKENS, layout.head_dim)
        block = KVBlock(
            keys=tuple(torch.randn(shape, generator=gen) for _ in range(layout.num_layers)),
            values=tuple(torch.randn(shape, generator=gen) for _ in range(layout.num_layers)),
        )
        meta = BlockMeta(
            key=key, parent_key=parent, namespace_digest=ns, owner=f"t{i}", tokens=token_bytes
        )
        chain.append((meta, block))
        parent = key
    return chain


def assert_bit_identical(got: KVBlock | None, want: KVBlock) -> None:
    assert got is not None
    assert got.num_layers == want.num_layers
    for a, b in zip((*got.keys, *got.values), (*want.keys, *want.values), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.contiguous().view(torch.uint8).numpy().tobytes() == (
            b.contiguous().view(torch.uint8).numpy().tobytes()
        )


def is_prefix_shaped(results: list[KVBlock | None]) -> bool:
    first_miss = next((i for i, r in enumerate(results) if r is None), len(results))
    return all(r is None for r in results[first_miss:])


@pytest.fixture
def open_store() -> Iterator[Callable[..., RedisStore]]:
    """Build and start RedisStores; every one is closed when the test ends."""
    stores: list[RedisStore] = []

    def build(url: str, codec: BlockCodec | None = None, **options: Any) -> RedisStore:
        store = RedisStore(codec if codec is not None else make_codec(), url=url, **options)
        stores.append(store)
        store.start()
        return store

    try:
        yield build
    finally:
        for store in stores:
            store.close()


def fast_breaker(clock: FakeClock, threshold: int = 3) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=threshold, reset_after_s=5.0, clock=clock)


# ---------------------------------------------------------------------------- round trips


def test_is_a_block_store(redis_server: RedisServer, open_store: Callable[..., RedisStore]) -> None:
    assert isinstance(open_store(redis_server.url), BlockStore)


def test_round_trip_is_bit_identical(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_server.url)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    assert_bit_identical(store.get(meta), block)
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.puts, stats.errors) == (1, 0, 1, 0)
    assert stats.is_available and stats.notes["breaker"] == "closed"


def test_chain_round_trip_on_cluster_spreads_over_masters(
    redis_cluster: RedisCluster, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_cluster.url, cluster=True)
    chain = make_chain(namespace("t"), 24)
    store.put_many(chain)
    got = store.get_many([meta for meta, _ in chain])
    for block, (_, want) in zip(got, chain, strict=True):
        assert_bit_identical(block, want)
    keys_per_node = [node.command("DBSIZE") for node in redis_cluster.nodes]
    assert sum(keys_per_node) == 24  # type: ignore[arg-type]
    assert sum(1 for n in keys_per_node if n) == len(redis_cluster.nodes)


def test_chain_batches_take_one_round_trip(
    fault_proxy: FaultProxy, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(fault_proxy.url, socket_timeout_s=2.0)  # start() opened a connection
    chain = make_chain(namespace("t"), 8)
    fault_proxy.delay(100)
    began = time.perf_counter()
    store.put_many(chain)
    put_s = time.perf_counter() - began
    began = time.perf_counter()
    got = store.get_many([meta for meta, _ in chain])
    get_s = time.perf_counter() - began
    assert all(block is not None for block in got)
    assert put_s < 0.4 and get_s < 0.4  # 8 round trips would take >= 0.8 s


def test_put_keeps_the_first_value(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_server.url)
    [(meta, first)] = make_chain(namespace("t"), 1, seed=1)
    [(_, second)] = make_chain(namespace("t"), 1, seed=2)
    store.put(meta, first)
    store.put(meta, second)
    assert_bit_identical(store.get(meta), first)
    assert store.stats().puts == 1
    assert store.stats().notes["num_put_existing"] == 1


def test_put_sets_the_ttl(redis_server: RedisServer, open_store: Callable[..., RedisStore]) -> None:
    store = open_store(redis_server.url, ttl_s=120.0)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    pttl = redis_server.command("PTTL", store.redis_key(meta))
    assert isinstance(pttl, int) and 110_000 < pttl <= 120_000


def test_hit_restarts_the_ttl(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_server.url, ttl_s=120.0)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    redis_server.command("PEXPIRE", store.redis_key(meta), 5000)
    assert store.get(meta) is not None
    pttl = redis_server.command("PTTL", store.redis_key(meta))
    assert isinstance(pttl, int) and pttl > 110_000


def test_no_ttl_keeps_keys_without_expiry(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_server.url, ttl_s=None)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    assert store.get(meta) is not None
    assert redis_server.command("PTTL", store.redis_key(meta)) == -1


def test_delete_contains_and_delete_meta(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    writer = open_store(redis_server.url)
    reader = open_store(redis_server.url)
    (meta_a, block_a), (meta_b, block_b) = make_chain(namespace("t"), 2)
    writer.put_many([(meta_a, block_a), (meta_b, block_b)])
    assert writer.contains(meta_a.key)
    writer.delete(meta_a.key)
    assert not writer.contains(meta_a.key)
    reader.delete(meta_b.key)  # never seen by this process: needs delete_meta
    assert reader.stats().notes["num_delete_unknown"] == 1
    assert reader.contains_meta(meta_b)
    reader.delete_meta(meta_b)
    assert not reader.contains_meta(meta_b)
    assert redis_server.command("DBSIZE") == 0


# ------------------------------------------------------------------------------ outages


def test_absent_at_start_is_off_without_stalls(
    open_store: Callable[..., RedisStore], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    store = open_store(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    assert not store.stats().is_available
    [(meta, block)] = make_chain(namespace("t"), 1)
    began = time.perf_counter()
    results = [store.get(meta) for _ in range(100)]
    assert time.perf_counter() - began < 0.05
    assert results == [None] * 100
    store.put(meta, block)
    stats = store.stats()
    assert stats.puts == 0 and stats.notes["num_dropped_puts"] == 1
    assert stats.misses == 100 and stats.notes["num_skipped_breaker_open"] == 101
    assert stats.notes["errors.ConnectionError"] == 1
    assert [r.levelname for r in caplog.records if r.name == "tiers.redis_store"] == ["WARNING"]


def test_absent_cluster_at_start_is_off(
    open_store: Callable[..., RedisStore], caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(f"redis://127.0.0.1:{free_port()}/0", cluster=True)
    [(meta, _)] = make_chain(namespace("t"), 1)
    assert store.get(meta) is None
    assert not store.stats().is_available
    assert store.stats().errors == 1


def test_killed_then_restarted_recovers_after_the_breaker_resets(
    redis_server_factory: Callable[..., RedisServer], open_store: Callable[..., RedisStore]
) -> None:
    server = redis_server_factory(appendonly=True)
    clock = FakeClock()
    store = open_store(server.url, breaker=fast_breaker(clock))
    chain = make_chain(namespace("t"), 3)
    metas = [meta for meta, _ in chain]
    store.put_many(chain[:2])
    server.kill()
    assert [store.get(metas[0]) for _ in range(5)] == [None] * 5  # no exception
    store.put(*chain[2])  # dropped
    assert store.stats().errors == 3 and store.stats().notes["breaker"] == "open"
    server.start()
    assert store.get(metas[0]) is None  # still open: not even tried
    clock.now += 5.0
    got = store.get_many(metas)  # the probe: AOF kept the first two blocks
    assert_bit_identical(got[0], chain[0][1])
    assert_bit_identical(got[1], chain[1][1])
    assert got[2] is None
    store.put(*chain[2])
    assert_bit_identical(store.get(metas[2]), chain[2][1])
    assert store.stats().is_available


def test_open_breaker_touches_no_network(
    fault_proxy: FaultProxy, open_store: Callable[..., RedisStore]
) -> None:
    clock = FakeClock()
    store = open_store(fault_proxy.url, breaker=fast_breaker(clock), socket_timeout_s=0.05)
    [(meta, block)] = make_chain(namespace("t"), 1)
    fault_proxy.blackhole()
    assert [store.get(meta) for _ in range(3)] == [None] * 3  # 3 timeouts open the breaker
    seen = (fault_proxy.num_connections, fault_proxy.num_bytes_from_client)
    began = time.perf_counter()
    for _ in range(100):
        assert store.get(meta) is None
        store.put(meta, block)
    assert time.perf_counter() - began < 0.05
    assert (fault_proxy.num_connections, fault_proxy.num_bytes_from_client) == seen
    assert store.stats().notes["errors.TimeoutError"] == 3


# ------------------------------------------------------------------------- proxy faults


@pytest.mark.parametrize("fault", ["delay", "blackhole"])
def test_stalled_redis_costs_one_socket_timeout(
    fault: str, fault_proxy: FaultProxy, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(fault_proxy.url, socket_timeout_s=0.2)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    if fault == "delay":
        fault_proxy.delay(2000)
    else:
        fault_proxy.blackhole()
    began = time.perf_counter()
    assert store.get(meta) is None
    assert time.perf_counter() - began < 0.2 + 0.3
    stats = store.stats()
    assert stats.errors == 1 and stats.notes["errors.TimeoutError"] == 1
    assert stats.is_available  # one failure does not open the breaker


def test_connection_reset_mid_reply_is_a_miss(
    fault_proxy: FaultProxy, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(fault_proxy.url)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    fault_proxy.reset_after(100)  # the value is ~1.3 kB
    assert store.get(meta) is None
    assert store.stats().notes["errors.ConnectionError"] == 1
    fault_proxy.pass_through()
    assert_bit_identical(store.get(meta), block)  # a new connection works


def test_refused_connection_is_a_quick_miss(
    fault_proxy: FaultProxy, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(fault_proxy.url)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    fault_proxy.refuse()
    began = time.perf_counter()
    assert store.get(meta) is None
    assert store.get(meta) is None
    assert time.perf_counter() - began < 0.2
    assert store.stats().notes["errors.ConnectionError"] == 2


@pytest.mark.parametrize("bytes_per_s", [40_000, 5])
def test_trickle_serves_hits_or_misses_never_garbage(
    bytes_per_s: int, fault_proxy: FaultProxy, open_store: Callable[..., RedisStore]
) -> None:
    # NOTE: 40 kB/s keeps every read under the socket timeout (a slow hit); 5 B/s sends one
    # byte per 0.2 s, so the read times out after part of the reply (a miss).
    store = open_store(fault_proxy.url, socket_timeout_s=0.1)
    chain = make_chain(namespace("t"), 4)
    store.put_many(chain)
    fault_proxy.trickle(bytes_per_s)
    for _ in range(3):
        got = store.get_many([meta for meta, _ in chain])
        assert is_prefix_shaped(got)
        for block, (_, want) in zip(got, chain, strict=True):
            if block is not None:
                assert_bit_identical(block, want)
    stats = store.stats()
    assert stats.verification_failures == {}
    assert stats.hits + stats.misses == 12
    assert stats.hits == (12 if bytes_per_s > 1000 else 0)


# ----------------------------------------------------------------------- untrusted bytes


def test_garbage_value_is_a_counted_miss_and_deleted(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_server.url)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    redis_server.command("SET", store.redis_key(meta), b"\x80\x04garbage, maybe a pickle" * 20)
    assert store.get(meta) is None
    assert store.stats().verification_failures == {"magic": 1}
    assert redis_server.command("EXISTS", store.redis_key(meta)) == 0


def test_non_string_value_is_a_counted_miss_and_deleted(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_server.url)
    [(meta, _)] = make_chain(namespace("t"), 1)
    redis_server.command("LPUSH", store.redis_key(meta), "x")
    assert store.get(meta) is None
    assert store.stats().verification_failures == {"type": 1}
    assert store.stats().errors == 0
    assert redis_server.command("EXISTS", store.redis_key(meta)) == 0


def test_value_from_another_deployment_secret_is_rejected(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    ours = open_store(redis_server.url)
    theirs = open_store(redis_server.url, codec=make_codec(OTHER_SECRET))
    [(meta, block)] = make_chain(namespace("t"), 1)
    theirs.put(meta, block)
    assert ours.get(meta) is None
    assert ours.stats().verification_failures == {"mac": 1}
    assert redis_server.command("EXISTS", ours.redis_key(meta)) == 0


def test_format_1_value_is_a_counted_miss_and_deleted(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_server.url)
    [(meta, block)] = make_chain(namespace("t"), 1)
    old = encode_format_1(make_codec(), derive_mac_key(SECRET), meta, block)
    redis_server.command("SET", store.redis_key(meta), old)
    assert store.get(meta) is None
    assert store.stats().verification_failures == {"version": 1}
    assert redis_server.command("EXISTS", store.redis_key(meta)) == 0


def test_value_forged_to_keep_its_xxh3_is_a_counted_miss_and_deleted(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    store = open_store(redis_server.url)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    value = redis_server.command("GET", store.redis_key(meta))
    assert isinstance(value, bytes)
    header_len = BlockCodec.header_length(value)
    forged, _ = forge_keeping_xxh3(value[header_len:], b"\x7f" * (len(value) - header_len))
    redis_server.command("SET", store.redis_key(meta), value[:header_len] + forged)
    assert store.get(meta) is None
    assert store.stats().verification_failures == {"payload_mac": 1}
    assert redis_server.command("EXISTS", store.redis_key(meta)) == 0


def test_oversized_value_is_rejected_before_decoding(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    codec = make_codec(codec_class=SpyCodec)
    store = open_store(redis_server.url, codec=codec)
    limit = default_max_value_bytes(LAYOUT, BLOCK_TOKENS)
    [(meta, _)] = make_chain(namespace("t"), 1)
    redis_server.command("SET", store.redis_key(meta), b"\0" * (4 << 20))

    def bytes_sent() -> int:
        info = redis_server.command("INFO", "stats")
        assert isinstance(info, bytes)
        line = next(x for x in info.splitlines() if x.startswith(b"total_net_output_bytes:"))
        return int(line.split(b":")[1])

    before = bytes_sent()
    assert store.get(meta) is None
    assert bytes_sent() - before < limit + 64 * 1024  # never read the 4 MiB
    assert isinstance(codec, SpyCodec) and codec.num_decodes == 0
    assert store.stats().verification_failures == {"size": 1}
    assert redis_server.command("EXISTS", store.redis_key(meta)) == 0


def test_restart_with_foreign_data_is_never_served(
    redis_server_factory: Callable[..., RedisServer], open_store: Callable[..., RedisStore]
) -> None:
    server = redis_server_factory(appendonly=True)
    ns = namespace("tenant")
    other_model = KVLayout(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float32)
    other_secret_chain = make_chain(ns, 3, seed=1)
    other_model_chain = make_chain(ns, 3, seed=2, layout=other_model)
    other_namespace_chain = make_chain(namespace("other model's namespace"), 3, seed=3)
    with_other_secret = open_store(server.url, codec=make_codec(OTHER_SECRET))
    with_other_model = open_store(server.url, codec=make_codec(layout=other_model))
    same_secret = open_store(server.url)
    with_other_secret.put_many(other_secret_chain)
    with_other_model.put_many(other_model_chain)
    same_secret.put_many(other_namespace_chain)
    server.restart()
    assert server.command("DBSIZE") == 9

    ours = open_store(server.url)
    # The same tokens as the other namespace's chain, asked for in our namespace.
    ours_for_those_tokens = [
        BlockMeta(
            key=meta.key, parent_key=meta.parent_key, namespace_digest=ns, owner="t",
            tokens=meta.tokens,
        )
        for meta, _ in other_namespace_chain
    ]  # fmt: skip
    assert ours.get_many([meta for meta, _ in other_secret_chain]) == [None] * 3
    assert ours.get_many([meta for meta, _ in other_model_chain]) == [None] * 3
    assert ours.get_many(ours_for_those_tokens) == [None] * 3
    stats = ours.stats()
    assert stats.hits == 0
    assert stats.verification_failures == {"mac": 1, "shape": 1}


@pytest.mark.parametrize("password", [None, "not-" + PASSWORD], ids=["missing", "wrong"])
def test_wrong_password_turns_the_tier_off_with_one_quiet_warning(
    password: str | None,
    redis_server_factory: Callable[..., RedisServer],
    open_store: Callable[..., RedisStore],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    server = redis_server_factory(password=PASSWORD)
    clock = FakeClock()
    url = server.url_with(password=password, username="default" if password else "")
    store = open_store(url, breaker=fast_breaker(clock))
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    assert store.get(meta) is None
    assert not store.stats().is_available
    clock.now += 5.0
    assert store.get(meta) is None  # the probe fails the same way, and logs nothing new
    stats = store.stats()
    assert not stats.is_available
    assert stats.notes["errors.AuthenticationError"] == 2
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "authentication failed" in warnings[0].getMessage()
    logged = "\n".join(r.getMessage() for r in caplog.records) + caplog.text
    assert PASSWORD not in logged
    assert password is None or password not in logged


def test_right_password_works_and_is_never_logged(
    redis_server_factory: Callable[..., RedisServer],
    open_store: Callable[..., RedisStore],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    server = redis_server_factory(password=PASSWORD)
    store = open_store(server.url)
    [(meta, block)] = make_chain(namespace("t"), 1)
    store.put(meta, block)
    assert_bit_identical(store.get(meta), block)
    assert "redis://:***@127.0.0.1" in caplog.text
    assert PASSWORD not in caplog.text


def test_bad_url_is_a_config_error_without_the_password() -> None:
    store = RedisStore(make_codec(), url=f"http://user:{PASSWORD}@127.0.0.1:1/0")
    with pytest.raises(TierConfigError) as info:
        store.start()
    assert PASSWORD not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_needs_exactly_one_of_url_and_client() -> None:
    with pytest.raises(TierConfigError):
        RedisStore(make_codec())
    with pytest.raises(TierConfigError):
        RedisStore(make_codec(), client=object())


# ------------------------------------------------------------------ eviction and prefixes


def test_get_many_stops_decoding_after_the_first_miss(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    codec = make_codec(codec_class=SpyCodec)
    store = open_store(redis_server.url, codec=codec)
    chain = make_chain(namespace("t"), 6)
    store.put_many(chain)
    redis_server.command("DEL", store.redis_key(chain[2][0]))
    got = store.get_many([meta for meta, _ in chain])
    assert [block is not None for block in got] == [True, True, False, False, False, False]
    assert isinstance(codec, SpyCodec) and codec.num_decodes == 2
    stats = store.stats()
    assert (stats.hits, stats.misses) == (2, 4)
    assert stats.notes["num_not_decoded_after_miss"] == 3


def test_redis_eviction_never_serves_a_child_without_its_parent(
    redis_server_factory: Callable[..., RedisServer], open_store: Callable[..., RedisStore]
) -> None:
    server = redis_server_factory(maxmemory="4mb", maxmemory_policy="allkeys-lru")
    layout = KVLayout(num_layers=16, kv_heads=4, head_dim=64, dtype=torch.float32)
    store = open_store(server.url, codec=make_codec(layout=layout))
    chain = make_chain(namespace("t"), 48, layout=layout)  # 48 * 128 KiB, far over 4 MiB
    for at in range(0, len(chain), 8):
        store.put_many(chain[at : at + 8])
    present = server.command("DBSIZE")
    assert isinstance(present, int) and 0 < present < len(chain)
    got = store.get_many([meta for meta, _ in chain])
    assert is_prefix_shaped(got)
    num_hits = sum(block is not None for block in got)
    assert num_hits < present  # children Redis still held were not served without parents
    for block, (_, want) in zip(got[:num_hits], chain, strict=False):
        assert_bit_identical(block, want)


# ----------------------------------------------------------------------- flush namespace


def _flush_one_namespace(url: str, open_store: Callable[..., RedisStore], **options: Any) -> None:
    store = open_store(url, **options)
    tenant_a, tenant_b = namespace("a"), namespace("b")
    chain_a, chain_b = make_chain(tenant_a, 7, seed=1), make_chain(tenant_b, 5, seed=2)
    store.put_many(chain_a)
    store.put_many(chain_b)
    assert store.remove_where(namespace_digest=tenant_a) == 7
    assert store.get_many([meta for meta, _ in chain_a]) == [None] * 7
    assert all(block is not None for block in store.get_many([meta for meta, _ in chain_b]))
    assert store.remove_where(namespace_digest=tenant_a) == 0


def test_flush_namespace_removes_exactly_one_namespace(
    redis_server: RedisServer, open_store: Callable[..., RedisStore]
) -> None:
    redis_server.command("SET", "unrelated:key", "kept")
    _flush_one_namespace(redis_server.url, open_store)
    assert redis_server.command("GET", "unrelated:key") == b"kept"


def test_flush_namespace_on_cluster_scans_every_master(
    redis_cluster: RedisCluster, open_store: Callable[..., RedisStore]
) -> None:
    _flush_one_namespace(redis_cluster.url, open_store, cluster=True)
    assert sum(node.command("DBSIZE") for node in redis_cluster.nodes) == 5  # type: ignore[misc]
