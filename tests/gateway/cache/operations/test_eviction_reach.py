"""Eviction reaches everything it names (issue 11, item 2), in one replica: every selector
applies to Redis as well as to the local tiers, and Flush clears every block key of the
deployment, not only the namespaces this replica has seen. (Other replicas: the process tests
in ``tests/gateway/service/test_lifecycle_replicas.py``.)

A real Redis, a device tier carrying bytes, and ``FakeKeys`` (text -> token ids by code point)
for the prompt keys: the selection rules do not need a model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds
from policies.registry import TierPolicyConfig, build_tier_policy
from tests.gateway.cache.operations.test_admin import FakeKeys
from tests.redis_harness import RedisServer
from tiers.base import BlockMeta
from tiers.codec import BlockCodec, derive_mac_key
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.memory import DeviceStore
from tiers.payload import KVBlock, KVLayout
from tiers.redis_store import RedisStore

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
BLOCK = 2
SECRET = b"k" * 32
CODEC = BlockCodec(mac_key=derive_mac_key(SECRET), layout=LAYOUT, block_tokens=BLOCK)


def block_for(index: int) -> KVBlock:
    g = torch.Generator().manual_seed(index)
    shape = (LAYOUT.kv_heads, BLOCK, LAYOUT.head_dim)
    return KVBlock(keys=tuple(torch.randn(shape, generator=g) for _ in range(2)),
                   values=tuple(torch.randn(shape, generator=g) for _ in range(2)))


class Replica:
    """One replica's cache over the shared Redis, and its admin."""

    def __init__(self, url: str) -> None:
        self.keys = FakeKeys()
        self.remote = RedisStore(CODEC, url=url)
        self.remote.start()
        self.hierarchy = TierHierarchy(
            [TierLevel(name="device", store=DeviceStore(device="cpu"))], remote=self.remote)
        self.hierarchy.start()
        policy = build_tier_policy(TierPolicyConfig(budget_bytes=1 << 20))
        self.cache = PrefixCache(tiers=[TierSlot(name="device", policy=policy)],
                                 block_tokens=BLOCK, hierarchy=self.hierarchy, remote_write=True)
        self.admin = CacheAdmin(self.cache, keys=self.keys)

    def tokens(self, text: str) -> TokenIds:
        return self.keys.prompt_tokens(PromptInput(prompt=text))

    def store(self, tenant: str, text: str, *, tag: str | None = None) -> list[BlockMeta]:
        """Store ``text``'s blocks (written through to Redis, tagged ``tag``); their metas."""
        namespace = self.keys.namespace(Scope.of_tenant(tenant))
        with self.cache.acquire(namespace, self.tokens(text)) as lease:
            start = lease.match.num_blocks
            self.cache.insert(lease, tier="device", tag=tag,
                              blocks=[block_for(i) for i in range(start, len(lease.keys))])
            placement = self.cache.placement
            with placement.locked():
                records = [placement.index.get(key) for key in lease.keys]
                metas = [placement.meta(r) for r in records if r is not None]
        assert self.hierarchy.flush(timeout_s=10.0)
        return metas

    def close(self) -> None:
        self.hierarchy.close()


@pytest.fixture
def replica(redis_server: RedisServer) -> Iterator[Replica]:
    one = Replica(redis_server.url)
    yield one
    one.close()


def in_redis(server: RedisServer, replica: Replica, metas: list[BlockMeta]) -> list[bool]:
    return [server.command("EXISTS", replica.remote.redis_key(m)) == 1 for m in metas]


def test_evicting_by_key_removes_the_block_from_redis_too(
    replica: Replica, redis_server: RedisServer,
) -> None:
    metas = replica.store("alice", "abcdef")  # three blocks
    branch = replica.store("alice", "abcxyz")  # the first block shared, then its own
    assert in_redis(redis_server, replica, metas) == [True, True, True]
    # The second block's chain: it, what follows it, and no block another prompt continues
    # from (the first), here and in Redis; and a unique beginning of the key names it.
    replica.admin.evict(key_hex=metas[1].key.hex()[:12])
    assert in_redis(redis_server, replica, metas) == [True, False, False]
    assert in_redis(redis_server, replica, branch) == [True, True, True]
    assert replica.cache.lookup(replica.keys.namespace(Scope.of_tenant("alice")),
                                replica.tokens("abcdef")).num_blocks == 1
    replica.admin.evict(key_hex=branch[-1].key.hex())  # now alone: the whole prompt goes
    assert in_redis(redis_server, replica, branch) == [False, False, False]


def test_evicting_by_tag_removes_the_tagged_blocks_from_redis_too(
    replica: Replica, redis_server: RedisServer,
) -> None:
    tagged = replica.store("alice", "abcdef", tag="docs-v3")
    other = replica.store("alice", "uvwxyz")
    replica.admin.evict(tag="docs-v3")
    assert in_redis(redis_server, replica, tagged) == [False, False, False]
    assert in_redis(redis_server, replica, other) == [True, True, True]


def test_evicting_by_age_reaches_the_blocks_idle_in_redis(
    replica: Replica, redis_server: RedisServer,
) -> None:
    old = replica.store("alice", "abcd")
    time.sleep(2.1)  # Redis counts idle time in whole seconds
    new = replica.store("alice", "wxyz")
    replica.admin.evict(older_than_s=2)
    assert in_redis(redis_server, replica, old) == [False, False]
    assert in_redis(redis_server, replica, new) == [True, True]


def test_tier_redis_with_a_key_removes_only_the_redis_copy(
    replica: Replica, redis_server: RedisServer,
) -> None:
    alice, bob = replica.store("alice", "abcd"), replica.store("bob", "abcd")
    replica.admin.evict(key_hex=alice[0].key.hex(), tier="redis")
    assert in_redis(redis_server, replica, alice) == [False, False]  # the key's chain
    assert in_redis(redis_server, replica, bob) == [True, True]
    assert replica.cache.stats().num_blocks == 4  # the local copies stay


def test_flush_clears_every_block_key_of_the_deployment_even_of_unseen_namespaces(
    replica: Replica, redis_server: RedisServer,
) -> None:
    replica.store("alice", "abcd")
    other_model = derive_namespace(NamespaceSpec(
        deployment_secret=SECRET, model_fingerprint="another-model", kv_dtype="float32",
        device_kind="cpu", scope=Scope.of_tenant("carol")))
    elsewhere = BlockMeta(key=b"\x01" * 16, parent_key=b"\x00" * 16,  # type: ignore[arg-type]
                          namespace_digest=other_model.digest, owner="carol",
                          tokens=bytes(4 * BLOCK))
    replica.remote.put(elsewhere, block_for(9))  # written by a replica of another model
    redis_server.command("SET", "not-kvgate:key", "kept")  # another deployment's key
    assert redis_server.command("DBSIZE") == 4
    replica.admin.flush()
    assert redis_server.command("DBSIZE") == 1
    assert redis_server.command("EXISTS", "not-kvgate:key") == 1
    assert replica.cache.stats().num_blocks == 0
