"""The prefix cache: index, tier policy and reference counts kept in step.

Unit tests state one behaviour each; the state machine at the end drives random sequences of
requests, leases, pins, clock steps, sweeps and evictions against a naive reference model.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import cast

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from gateway.cache.prefix_cache import Lease, PrefixCache, TierSlot
from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import Namespace, NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from policies.base import BlockKey
from policies.registry import TierPolicyConfig, build_tier_policy

BLOCK = 2
BLOCK_BYTES = 10


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def namespace(tenant: str) -> Namespace:
    return derive_namespace(
        NamespaceSpec(
            deployment_secret=b"k" * 32,
            model_fingerprint="tiny",
            kv_dtype="float32",
            device_kind="cpu",
            scope=Scope.of_tenant(tenant),
        )
    )


NS = {t: namespace(t) for t in ("a", "b", "c")}


def make_cache(
    clock: FakeClock,
    *,
    budget: int = 1000,
    quotas: dict[str, int] | None = None,
    order: str = "lru",
    key_bytes: int = 16,
) -> PrefixCache:
    policy = build_tier_policy(
        TierPolicyConfig(order=order, budget_bytes=budget, quotas=quotas or {}), clock=clock
    )
    return PrefixCache(
        tiers=[TierSlot(name="device", policy=policy)],
        block_tokens=BLOCK,
        clock=clock,
        key_bytes=key_bytes,
    )


def toks(*ids: int) -> TokenIds:
    return as_token_ids(list(ids))


def store(cache: PrefixCache, tenant: str, tokens: TokenIds, ttl_s: float | None = None) -> None:
    with cache.acquire(NS[tenant], tokens) as lease:
        cache.insert(lease, tier="device", block_bytes=BLOCK_BYTES, ttl_s=ttl_s)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_stored_prompt_is_found_again(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4, 5))
    match = cache.lookup(NS["a"], toks(1, 2, 3, 4, 9, 9))
    assert (match.num_blocks, match.num_tokens, match.tiers) == (2, 4, ("device", "device"))
    assert match.diverges_at_block == 2
    cache.check_invariants()


def test_another_tenant_sees_nothing_of_it(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4))
    assert cache.lookup(NS["a"], toks(1, 2, 3, 4)).num_blocks == 2  # positive control
    assert cache.lookup(NS["b"], toks(1, 2, 3, 4)).num_blocks == 0


def test_a_lease_holds_references_until_released(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4))
    with cache.acquire(NS["a"], toks(1, 2, 3, 4)) as lease:
        assert [cache.refcount(k) for k in lease.match.keys] == [1, 1]
    assert cache.total_refcount() == 0
    assert lease.is_released


def test_a_lease_is_released_when_the_request_fails(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2))
    with pytest.raises(RuntimeError), cache.acquire(NS["a"], toks(1, 2)):
        raise RuntimeError("request failed mid-decode")
    assert cache.total_refcount() == 0


def test_blocks_in_use_are_not_evicted(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4))
    with cache.acquire(NS["a"], toks(1, 2, 3, 4)):
        result = cache.evict("device", 2 * BLOCK_BYTES)
        assert result.victims == ()
        assert not result.is_satisfied
    assert cache.evict("device", 2 * BLOCK_BYTES).freed_bytes == 2 * BLOCK_BYTES


def test_pinned_blocks_are_not_evicted_and_unpinning_releases_them(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4))
    assert cache.set_pinned(NS["a"], toks(1, 2, 3, 4), True) == 2
    assert cache.evict("device", BLOCK_BYTES).victims == ()
    cache.set_pinned(NS["a"], toks(1, 2, 3, 4), False)
    assert len(cache.evict("device", BLOCK_BYTES).victims) == 1


def test_eviction_takes_leaves_before_their_parents(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4, 5, 6))
    keys = cache.lookup(NS["a"], toks(1, 2, 3, 4, 5, 6)).keys
    result = cache.evict("device", 3 * BLOCK_BYTES)
    assert result.victims == tuple(reversed(keys))


def test_lru_evicts_the_least_recently_used_prompt(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 1))
    clock.advance(1)
    store(cache, "a", toks(2, 2))
    clock.advance(1)
    store(cache, "a", toks(1, 1))  # a hit: now the most recent
    result = cache.evict("device", BLOCK_BYTES)
    assert result.victims == cache_keys(cache, "a", toks(2, 2))


def cache_keys(cache: PrefixCache, tenant: str, tokens: TokenIds) -> tuple[bytes, ...]:
    fp = cache.fingerprinter(NS[tenant])
    return tuple(fp.block_keys(tokens))


def test_an_insert_that_cannot_fit_is_refused_not_forced(clock: FakeClock) -> None:
    cache = make_cache(clock, budget=2 * BLOCK_BYTES)
    store(cache, "a", toks(1, 2, 3, 4))
    cache.set_pinned(NS["a"], toks(1, 2, 3, 4), True)
    with cache.acquire(NS["a"], toks(5, 6)) as lease:
        result = cache.insert(lease, tier="device", block_bytes=BLOCK_BYTES)
    assert (result.num_new_blocks, result.num_refused_blocks) == (0, 1)
    assert result.refusal is not None
    assert cache.lookup(NS["a"], toks(5, 6)).num_blocks == 0
    cache.check_invariants()


def test_over_quota_a_tenant_evicts_only_its_own_blocks(clock: FakeClock) -> None:
    cache = make_cache(clock, budget=100, quotas={"a": 2 * BLOCK_BYTES})
    store(cache, "b", toks(9, 9))
    store(cache, "a", toks(1, 1))
    clock.advance(1)
    store(cache, "a", toks(2, 2))
    clock.advance(1)
    store(cache, "a", toks(3, 3))  # over quota: its own oldest block goes
    assert cache.lookup(NS["b"], toks(9, 9)).num_blocks == 1
    assert cache.lookup(NS["a"], toks(1, 1)).num_blocks == 0
    assert cache.lookup(NS["a"], toks(3, 3)).num_blocks == 1


def test_expired_blocks_are_never_returned_and_are_swept(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4), ttl_s=10)
    clock.advance(9.9)
    assert cache.lookup(NS["a"], toks(1, 2, 3, 4)).num_blocks == 2
    clock.advance(0.1)
    assert cache.lookup(NS["a"], toks(1, 2, 3, 4)).num_blocks == 0
    assert cache.sweep_expired() == 2
    assert cache.stats().num_blocks == 0


def test_a_hit_restarts_the_ttl(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2), ttl_s=10)
    clock.advance(8)
    store(cache, "a", toks(1, 2))  # a hit
    clock.advance(8)
    assert cache.lookup(NS["a"], toks(1, 2)).num_blocks == 1


def test_recomputing_an_expired_prefix_revives_it(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4), ttl_s=10)
    with cache.acquire(NS["a"], toks(1, 2, 3, 4)):
        clock.advance(20)  # expires while in use: cannot be swept
        store(cache, "a", toks(1, 2, 3, 4), ttl_s=10)
    assert cache.lookup(NS["a"], toks(1, 2, 3, 4)).num_blocks == 2
    cache.check_invariants()


def test_forced_key_collisions_are_caught_by_token_checks(clock: FakeClock) -> None:
    # 1-byte keys: 256 possible keys, so many distinct blocks share a key.
    cache = make_cache(clock, key_bytes=1, budget=10**6)
    stored = [toks(i, i + 1) for i in range(0, 600, 2)]
    for tokens in stored:
        store(cache, "a", tokens)
    for tokens in stored:
        match = cache.lookup(NS["a"], tokens)
        if match.num_blocks:
            assert match.keys == cache_keys(cache, "a", tokens)
    assert cache.stats().num_token_mismatches > 0
    cache.check_invariants()


def test_releasing_a_lease_twice_is_a_bug(clock: FakeClock) -> None:
    cache = make_cache(clock)
    with cache.acquire(NS["a"], toks(1, 2)) as lease:
        pass
    with pytest.raises(IndexInvariantError, match="twice"):
        cache._release(lease)


def test_unknown_tier_is_a_clear_error(clock: FakeClock) -> None:
    cache = make_cache(clock)
    with cache.acquire(NS["a"], toks(1, 2)) as lease:
        with pytest.raises(ValueError, match="unknown tier"):
            cache.insert(lease, tier="gpu9", block_bytes=1)


def test_stats_count_inserts_and_evictions_and_a_match_is_not_a_hit(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, "a", toks(1, 2, 3, 4))
    store(cache, "a", toks(1, 2, 3, 4))  # matched, but nothing was served: no hit
    cache.evict("device", BLOCK_BYTES)
    (tier,) = cache.stats().tiers
    assert (tier.hits, tier.inserts, tier.used_bytes) == (0, 2, BLOCK_BYTES)
    assert tier.evictions == {"admin": 1}


# ---- the state machine ------------------------------------------------------------------

TENANTS = ("a", "b")
QUOTA = 6 * BLOCK_BYTES
BUDGET = 14 * BLOCK_BYTES  # > the sum of quotas: the budget never forces cross-tenant eviction
TTL = 30.0
block_ids = st.lists(st.integers(0, 2), min_size=1, max_size=4)


def path_tokens(path: tuple[int, ...]) -> TokenIds:
    return as_token_ids([t for b in path for t in (b, b)])


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random requests against a reference model of what must and must not be cached."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.cache = make_cache(
            self.clock, budget=BUDGET, quotas={t: QUOTA for t in TENANTS}, order="clock"
        )
        self.ttl: dict[bytes, float | None] = {}
        self.last_access: dict[bytes, float] = {}
        self.pinned: set[bytes] = set()
        self.open: list[tuple[Lease, AbstractContextManager[Lease]]] = []
        self.owner: dict[bytes, str] = {}

    # -- model helpers
    def keys(self, tenant: str, path: tuple[int, ...]) -> list[bytes]:
        return list(self.cache.fingerprinter(NS[tenant]).block_keys(path_tokens(path)))

    def present(self, key: bytes) -> bool:
        return bool(self.cache.tiers_of(cast(BlockKey, key)))

    def live(self, key: bytes) -> bool:
        if not self.present(key):
            return False
        ttl = self.ttl.get(key)
        if ttl is None or key in self.pinned:
            return True
        return self.last_access[key] + ttl > self.clock.now

    def expected_match(self, tenant: str, path: tuple[int, ...]) -> int:
        n = 0
        for key in self.keys(tenant, path):
            if not self.live(key):
                break
            n += 1
        return n

    def held_keys(self) -> set[bytes]:
        return {k for lease, _ in self.open for k in lease.match.keys}

    # -- rules
    @rule(tenant=st.sampled_from(TENANTS), path=block_ids, ttl=st.sampled_from([None, TTL]))
    def request(self, tenant: str, path: list[int], ttl: float | None) -> None:
        tokens = path_tokens(tuple(path))
        others_before = {k for k, o in self.owner.items() if o != tenant and self.live(k)}
        expected = self.expected_match(tenant, tuple(path))
        keys = self.keys(tenant, tuple(path))
        with self.cache.acquire(NS[tenant], tokens) as lease:
            assert lease.match.num_blocks == expected
            was_present = [self.present(k) for k in keys]
            result = self.cache.insert(lease, tier="device", block_bytes=BLOCK_BYTES, ttl_s=ttl)
        stored = expected + result.num_new_blocks + result.num_existing_blocks
        for key, existed in zip(keys[:stored], was_present[:stored], strict=True):
            if not existed:
                self.ttl[key] = ttl
            self.last_access[key] = self.clock.now
            self.owner[key] = tenant
        # A tenant's insert never takes another tenant's live blocks.
        assert all(self.present(k) for k in others_before)

    @rule(tenant=st.sampled_from(TENANTS), path=block_ids)
    def open_lease(self, tenant: str, path: list[int]) -> None:
        ctx = self.cache.acquire(NS[tenant], path_tokens(tuple(path)))
        expected = self.expected_match(tenant, tuple(path))
        lease = ctx.__enter__()
        assert lease.match.num_blocks == expected
        for key in lease.match.keys:
            self.last_access[key] = self.clock.now
        self.open.append((lease, ctx))

    @precondition(lambda self: bool(self.open))
    @rule(data=st.data())
    def close_lease(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.open) - 1))
        _, ctx = self.open.pop(i)
        ctx.__exit__(None, None, None)

    @rule(tenant=st.sampled_from(TENANTS), path=block_ids, pin=st.booleans())
    def pin(self, tenant: str, path: list[int], pin: bool) -> None:
        tokens = path_tokens(tuple(path))
        matched = self.cache.lookup(NS[tenant], tokens).keys
        self.cache.set_pinned(NS[tenant], tokens, pin)
        for key in matched:
            if pin:
                self.pinned.add(key)
            elif key in self.pinned:
                self.pinned.discard(key)
                self.last_access[key] = self.clock.now

    @rule(seconds=st.sampled_from([1.0, 10.0, 40.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def sweep(self) -> None:
        self.cache.sweep_expired()
        # Nothing live was swept.
        for key in self.held_keys() | self.pinned:
            assert self.present(key)

    @rule(num_blocks=st.integers(1, 6), tenant=st.sampled_from((None, *TENANTS)))
    def evict(self, num_blocks: int, tenant: str | None) -> None:
        before = self.cache.stats().tiers[0].used_bytes
        result = self.cache.evict("device", num_blocks * BLOCK_BYTES, tenant=tenant)
        after = self.cache.stats().tiers[0].used_bytes
        assert before - after == result.freed_bytes
        assert result.is_satisfied == (result.freed_bytes >= num_blocks * BLOCK_BYTES)
        if tenant is not None:
            assert all(self.owner[k] == tenant for k in result.victims)

    # -- invariants
    @invariant()
    def structure_agrees_with_the_policy(self) -> None:
        self.cache.check_invariants()

    @invariant()
    def pinned_and_leased_blocks_stay(self) -> None:
        for key in self.held_keys() | self.pinned:
            assert self.present(key), "a pinned or leased block was evicted"

    @invariant()
    def refcounts_equal_open_leases(self) -> None:
        expected = sum(len(lease.match.keys) for lease, _ in self.open)
        assert self.cache.total_refcount() == expected

    @invariant()
    def budget_and_quotas_hold(self) -> None:
        (tier,) = self.cache.stats().tiers
        assert tier.used_bytes <= BUDGET
        for t in TENANTS:
            used = sum(BLOCK_BYTES for k, o in self.owner.items() if o == t and self.present(k))
            assert used <= QUOTA

    def teardown(self) -> None:
        for _, ctx in self.open:
            ctx.__exit__(None, None, None)
        assert self.cache.total_refcount() == 0


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_prefix_cache_state_machine = PrefixCacheMachine.TestCase
