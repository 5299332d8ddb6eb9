"""KV events for routers, as a router sees them: real ZeroMQ sockets, decoded with vLLM's structs
(``tests.gateway.service.kv_events_router``, written apart from kvgate's own copy). The cache is
the real ``PrefixCache`` (metadata only, or over real device and host stores where a test needs
bytes to move).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq

from gateway.cache.operations.admin import evict_where
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.fingerprint import Namespace, NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from gateway.service.kv_events.publisher import KVEventPublisher, KVEventsError
from policies.base import BlockKey
from policies.registry import TierPolicyConfig, build_tier_policy
from tests.gateway.service.kv_events_router import (
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Subscriber,
    replay,
    wait_for_messages,
    wait_until,
    wire_hash,
)
from tiers.base import BlockMeta
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore
from tiers.payload import KVBlock, KVLayout

# ---- the cache --------------------------------------------------------------------------

BLOCK = 2
LAYOUT = KVLayout(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)
NBYTES = LAYOUT.block_nbytes(BLOCK)


def namespace(scope: Scope) -> Namespace:
    return derive_namespace(NamespaceSpec(deployment_secret=b"k" * 32, model_fingerprint="tiny",
                                          kv_dtype="float32", device_kind="cpu", scope=scope))


TENANT_A = namespace(Scope.of_tenant("a"))
TENANT_B = namespace(Scope.of_tenant("b"))
SHARED = namespace(Scope.shared())


def slot(name: str, num_blocks: int) -> TierSlot:
    return TierSlot(name=name, policy=build_tier_policy(
        TierPolicyConfig(budget_bytes=num_blocks * NBYTES)))


def metadata_cache(events: KVEventPublisher, *, device_blocks: int = 16) -> PrefixCache:
    """A cache of one device tier that keeps metadata only (an evicted block is dropped)."""
    return PrefixCache(tiers=[slot("device", device_blocks)], block_tokens=BLOCK, events=events)


def insert(cache: PrefixCache, ns: Namespace, tokens: TokenIds) -> list[BlockKey]:
    with cache.acquire(ns, tokens) as lease:
        cache.insert(lease, tier="device", block_bytes=NBYTES)
        return lease.keys


def block(seed: int) -> KVBlock:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.kv_heads, BLOCK, LAYOUT.head_dim)
    return KVBlock(keys=(torch.randn(shape, generator=g),),
                   values=(torch.randn(shape, generator=g),))


# ---- a router's sockets -----------------------------------------------------------------


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                           topic=TOPIC, buffer_size=64)
    pub.start()
    yield pub
    pub.close()


@pytest.fixture
def subscribe(context: zmq.Context[zmq.Socket[bytes]]
              ) -> Iterator[Callable[[KVEventPublisher], Subscriber]]:
    """Makes a router's SUB socket to a publisher; closes them all when the test ends."""
    made: list[Subscriber] = []

    def make(publisher: KVEventPublisher) -> Subscriber:
        made.append(Subscriber(context, publisher))
        return made[-1]

    yield make
    for sub in made:
        sub.sock.close(linger=0)


Subscribe = Callable[[KVEventPublisher], Subscriber]


def stored(events: list[Any]) -> list[BlockStored]:
    assert all(isinstance(e, BlockStored) for e in events), events
    return events


# ---- what a router sees -------------------------------------------------------------------


def test_a_cold_prompt_publishes_one_block_stored_per_block_chained_to_its_parent(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    cache = metadata_cache(publisher)
    keys = insert(cache, TENANT_A, as_token_ids([11, 12, 13, 14, 15, 16, 17]))

    events = stored(sub.events(3))
    assert [e.token_ids for e in events] == [[11, 12], [13, 14], [15, 16]]
    assert [e.block_hashes for e in events] == [[wire_hash(k)] for k in keys]
    assert [e.parent_block_hash for e in events] == [None, wire_hash(keys[0]),
                                                      wire_hash(keys[1])]
    assert {(e.medium, e.block_size, e.lora_id, e.lora_name, e.group_idx,
             e.kv_cache_spec_kind) for e in events} == {
        ("GPU", BLOCK, None, None, 0, "full_attention")}
    # The tenant's id where vLLM puts the cache salt: on the first block only.
    first_keys = events[0].extra_keys
    assert first_keys is not None and len(first_keys) == 1 and first_keys[0] is not None
    (tag,) = first_keys[0]
    assert isinstance(tag, str) and tag
    assert [e.extra_keys for e in events[1:]] == [[None], [None]]


def test_the_stream_is_a_positional_batch_of_maps_tagged_by_type(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    insert(metadata_cache(publisher), TENANT_A, as_token_ids([1, 2]))
    assert sub.sock.poll(5000)
    _, _, payload = sub.sock.recv_multipart()
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0  # [ts, events, dp rank]
    (event,) = raw[1]
    assert event["type"] == "BlockStored"
    assert event["token_ids"] == [1, 2] and event["medium"] == "GPU"
    assert "kv_cache_spec_sliding_window" not in event  # defaults are left out


def test_tenants_get_different_opaque_ids_and_the_shared_scope_none(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    cache = metadata_cache(publisher)
    prompt = as_token_ids([5, 6])
    for ns in (TENANT_A, TENANT_B, SHARED):
        insert(cache, ns, prompt)
    a, b, shared = stored(sub.events(3))
    assert a.extra_keys is not None and b.extra_keys is not None
    assert a.extra_keys != b.extra_keys
    assert shared.extra_keys == [None]
    for ns, event in ((TENANT_A, a), (TENANT_B, b)):
        assert event.extra_keys is not None and event.extra_keys[0] is not None
        (tag,) = event.extra_keys[0]
        assert ns.digest.hex() not in tag and tag not in ns.digest.hex()
        assert "a" != tag and "b" != tag  # not the tenant's name either
    assert len({a.block_hashes[0], b.block_hashes[0], shared.block_hashes[0]}) == 3


def test_an_eviction_publishes_block_removed_children_first(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    cache = metadata_cache(publisher, device_blocks=2)
    first = insert(cache, TENANT_A, as_token_ids([1, 1, 2, 2]))
    assert len(stored(sub.events(2))) == 2
    second = insert(cache, TENANT_A, as_token_ids([3, 3, 4, 4]))

    # Room for each block of the second prompt: the first prompt's leaf goes, then its parent.
    events = sub.events(4)
    assert [(type(e).__name__, e.block_hashes, e.medium) for e in events
            if isinstance(e, BlockStored | BlockRemoved)] == [
        ("BlockRemoved", [wire_hash(first[1])], "GPU"),
        ("BlockStored", [wire_hash(second[0])], "GPU"),
        ("BlockRemoved", [wire_hash(first[0])], "GPU"),
        ("BlockStored", [wire_hash(second[1])], "GPU"),
    ]


def test_a_ttl_expiry_in_the_device_tier_is_published(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    now = [100.0]
    cache = PrefixCache(tiers=[slot("device", 8)], block_tokens=BLOCK, events=publisher,
                        clock=lambda: now[0])
    tokens = as_token_ids([1, 2, 3, 4])
    with cache.acquire(TENANT_A, tokens) as lease:
        cache.insert(lease, tier="device", block_bytes=NBYTES, ttl_s=5.0)
        keys = lease.keys
    sub.events(2)
    now[0] += 6.0
    assert cache.sweep_expired() == 2
    assert [(type(e).__name__, e.block_hashes, e.medium) for e in sub.events(2)
            if isinstance(e, BlockRemoved)] == [
        ("BlockRemoved", [wire_hash(keys[1])], "GPU"),  # the leaf first
        ("BlockRemoved", [wire_hash(keys[0])], "GPU"),
    ]


def test_a_demotion_publishes_the_host_copy_before_the_device_removal(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    hierarchy = TierHierarchy([
        TierLevel(name="device", store=DeviceStore(device="cpu")),
        TierLevel(name="host", store=HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK,
                                               budget_bytes=8 * NBYTES)),
    ])
    cache = PrefixCache(tiers=[slot("device", 1), slot("host", 8)], block_tokens=BLOCK,
                        hierarchy=hierarchy, events=publisher)
    keys = []
    for seed, tokens in enumerate(([1, 1], [2, 2])):
        with cache.acquire(TENANT_A, as_token_ids(tokens)) as lease:
            cache.insert(lease, tier="device", blocks=[block(seed)])
            keys.append(lease.keys[0])

    events = sub.events(4)
    assert [(type(e).__name__, e.block_hashes[0], e.medium) for e in events
            if isinstance(e, BlockStored | BlockRemoved)] == [
        ("BlockStored", wire_hash(keys[0]), "GPU"),
        ("BlockStored", wire_hash(keys[0]), "CPU"),   # demoted: the host copy first,
        ("BlockRemoved", wire_hash(keys[0]), "GPU"),  # then the device copy leaves
        ("BlockStored", wire_hash(keys[1]), "GPU"),
    ]


def test_sequence_numbers_start_at_zero_and_increase_by_one(
        context: zmq.Context[zmq.Socket[bytes]], subscribe: Subscribe,
        publisher: KVEventPublisher) -> None:
    cache = metadata_cache(publisher)
    for i in range(5):
        insert(cache, TENANT_A, as_token_ids([i, i]))
        wait_for_messages(publisher, i + 1)  # one message each
    assert [seq for seq, _ in replay(context, publisher, 0)] == [0, 1, 2, 3, 4]

    sub = subscribe(publisher)
    start = publisher.num_messages
    for i in range(5):
        insert(cache, TENANT_A, as_token_ids([10 + i, 10 + i]))
        wait_for_messages(publisher, start + i + 1)
    assert [sub.receive()[0] for _ in range(5)] == list(range(start, start + 5))


def test_a_late_joiner_gets_the_missed_events_through_replay(
        context: zmq.Context[zmq.Socket[bytes]], publisher: KVEventPublisher) -> None:
    cache = metadata_cache(publisher)
    keys = insert(cache, TENANT_A, as_token_ids([1, 2, 3, 4]))  # nobody listens yet
    wait_until(lambda: publisher.num_events == 2)

    missed = replay(context, publisher, 0)
    events = [e for _, batch in missed for e in batch.events]
    assert [e.block_hashes for e in stored(events)] == [[wire_hash(k)] for k in keys]
    assert replay(context, publisher, publisher.num_messages) == []  # nothing after the last


def test_replay_keeps_only_the_newest_buffer_size_messages(
        context: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = KVEventPublisher(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                           topic=TOPIC, buffer_size=3)
    pub.start()
    try:
        for i in range(6):
            pub.cleared()
            wait_for_messages(pub, i + 1)
        assert [seq for seq, _ in replay(context, pub, 0)] == [3, 4, 5]
    finally:
        pub.close()


def test_a_full_queue_drops_and_counts_and_never_blocks(
        context: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = KVEventPublisher(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                           topic=TOPIC, max_queue=2)
    meta = BlockMeta(key=BlockKey(b"\x01" * 16), parent_key=BlockKey(bytes(16)),
                     namespace_digest=TENANT_A.digest, owner="a", tokens=bytes(8))
    # Not started: nothing drains the queue, as when the thread falls behind.
    def five_stores() -> None:
        for _ in range(5):
            pub.stored(meta, "device")

    calls = threading.Thread(target=five_stores)
    calls.start()
    calls.join(timeout=5.0)
    assert not calls.is_alive()
    assert pub.num_dropped == 3
    pub.start()
    try:
        wait_until(lambda: pub.num_events == 2)
        (only,) = replay(context, pub, 0)
        assert len(only[1].events) == 2  # what the queue held, in one batch
    finally:
        pub.close()


def test_evicting_everything_publishes_all_blocks_cleared_after_the_removals(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    cache = metadata_cache(publisher)
    keys = insert(cache, TENANT_A, as_token_ids([1, 2, 3, 4]))
    sub.events(2)
    evict_where(cache)
    leaf, parent, cleared = sub.events(3)
    assert isinstance(leaf, BlockRemoved) and isinstance(parent, BlockRemoved)
    assert (leaf.block_hashes, parent.block_hashes) == ([wire_hash(keys[1])],
                                                        [wire_hash(keys[0])])
    assert isinstance(cleared, AllBlocksCleared)


def test_a_partial_eviction_says_nothing_is_cleared(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    cache = metadata_cache(publisher)
    insert(cache, TENANT_A, as_token_ids([1, 2]))
    insert(cache, TENANT_B, as_token_ids([1, 2]))
    sub.events(2)
    evict_where(cache, owner="a")
    publisher.cleared()  # a marker: what came before it is all the eviction said
    removal, marker = sub.events(2)
    assert isinstance(removal, BlockRemoved) and isinstance(marker, AllBlocksCleared)


def test_disk_copies_are_not_published(
        subscribe: Subscribe, publisher: KVEventPublisher) -> None:
    sub = subscribe(publisher)
    meta = BlockMeta(key=BlockKey(b"\x02" * 16), parent_key=BlockKey(bytes(16)),
                     namespace_digest=TENANT_A.digest, owner="a", tokens=bytes(8))
    publisher.stored(meta, "disk")
    publisher.removed(meta.key, "disk")
    publisher.cleared()
    seq, batch = sub.receive()
    assert [type(e) for e in batch.events] == [AllBlocksCleared]


def test_an_ipc_endpoint_publishes_too(subscribe: Subscribe,
                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    where: Path = tmp_path_factory.mktemp("ev")
    pub = KVEventPublisher(endpoint=f"ipc://{where}/pub", topic=TOPIC)
    pub.start()
    try:
        sub = subscribe(pub)
        insert(metadata_cache(pub), TENANT_A, as_token_ids([7, 8]))
        (event,) = stored(sub.events(1))
        assert event.token_ids == [7, 8]
    finally:
        pub.close()


def test_an_endpoint_in_use_fails_start_with_a_message(
        publisher: KVEventPublisher) -> None:
    second = KVEventPublisher(endpoint=publisher.endpoint)
    with pytest.raises(KVEventsError, match="cannot publish KV events"):
        second.start()
    second.close()
