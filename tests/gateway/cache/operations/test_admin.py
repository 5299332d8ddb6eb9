"""Admin selection and ``CacheAdmin``: what an operator's list, evict, pin and quota reach.

A metadata-only cache (no bytes) and a fake ``PromptKeys`` (text -> token ids by code point)
keep these to the selection rules; the engine-keyed path is covered in
``tests/gateway/engine/test_engine.py`` and over gRPC in ``tests/gateway/service``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from gateway.cache.operations.admin import CacheAdmin, evict_where, list_prefixes, prompt_blocks
from gateway.cache.operations.invalidation import EventBounds, EvictionEvent
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.canonical import PromptInput
from gateway.core.errors import CanonicalizationError, InvalidRequest
from gateway.core.fingerprint import (
    BlockFingerprinter,
    Namespace,
    NamespaceSpec,
    Scope,
    derive_namespace,
)
from gateway.core.tokens import TokenIds, as_token_ids
from policies.base import BlockKey
from policies.registry import TierPolicyConfig, build_tier_policy

BLOCK = 2
BLOCK_BYTES = 10
EVENT_BOUNDS = EventBounds(max_prefix_chars=262_144, max_tenant_chars=128)
"""The bounds of a gateway with the default ``[limits]``, for events read from a stream."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeKeys:
    """``PromptKeys`` without a model: a text's tokens are its code points mod 50."""

    def __init__(self) -> None:
        self.namespaces: dict[Scope, Namespace] = {}

    def namespace(self, scope: Scope) -> Namespace:
        if scope not in self.namespaces:
            self.namespaces[scope] = derive_namespace(NamespaceSpec(
                deployment_secret=b"k" * 32, model_fingerprint="tiny", kv_dtype="float32",
                device_kind="cpu", scope=scope))
        return self.namespaces[scope]

    def known_namespaces(self) -> list[Namespace]:
        return list(self.namespaces.values())

    def prompt_tokens(self, prompt: PromptInput) -> TokenIds:
        if prompt.token_ids is not None:
            return as_token_ids(list(prompt.token_ids))
        if prompt.prompt is None:  # like a tokenizer without a chat template
            raise CanonicalizationError("this tokenizer has no chat template")
        return as_token_ids([ord(c) % 50 for c in prompt.prompt])

    def preview(self, token_ids: Sequence[int]) -> str:
        return ",".join(map(str, token_ids))


KEYS = FakeKeys()
ALICE = KEYS.namespace(Scope.of_tenant("alice"))
BOB = KEYS.namespace(Scope.of_tenant("bob"))


def toks(*ids: int) -> TokenIds:
    return as_token_ids(list(ids))


def make_cache(clock: FakeClock) -> PrefixCache:
    policy = build_tier_policy(TierPolicyConfig(order="lru", budget_bytes=1000), clock=clock)
    return PrefixCache(tiers=[TierSlot(name="device", policy=policy)], block_tokens=BLOCK,
                       clock=clock)


def store(cache: PrefixCache, namespace: Namespace, tokens: TokenIds, *,
          tag: str | None = None) -> None:
    """What a request's store step does: its prompt's full blocks inserted (and tagged)."""
    with cache.acquire(namespace, tokens) as lease:
        cache.insert(lease, tier="device", block_bytes=BLOCK_BYTES, tag=tag)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_one_entry_per_cached_prompt_most_recent_first(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, ALICE, toks(1, 2, 3, 4))
    clock.now += 5
    store(cache, ALICE, toks(1, 2, 5, 6, 7, 8))
    clock.now += 5
    store(cache, BOB, toks(9, 9))
    listed = list_prefixes(cache)
    assert [(p.tenant, p.num_blocks, p.num_bytes) for p in listed] == [
        ("bob", 1, BLOCK_BYTES), ("alice", 3, 3 * BLOCK_BYTES), ("alice", 2, 2 * BLOCK_BYTES)]
    assert [p.idle_s for p in listed] == [0.0, 5.0, 10.0]
    assert [p.tenant for p in list_prefixes(cache, owner="alice", limit=1)] == ["alice"]
    assert all(p.tiers == ("device",) and not p.is_pinned for p in listed)


def test_evicting_a_prefix_takes_what_follows_it_and_keeps_what_others_share(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    store(cache, ALICE, toks(1, 2, 3, 4, 5, 6))
    store(cache, ALICE, toks(1, 2, 7, 8))
    freed = evict_where(cache, under=prompt_blocks(cache, ALICE, toks(1, 2, 3, 4)))
    assert freed == {"device": 2 * BLOCK_BYTES}  # (3, 4) and (5, 6); (1, 2) is still shared
    assert cache.lookup(ALICE, toks(1, 2, 7, 8)).num_blocks == 2
    assert cache.lookup(ALICE, toks(1, 2, 3, 4)).num_blocks == 1
    cache.check_invariants()


def test_eviction_selects_by_owner_and_by_age_and_spares_blocks_in_use(
    clock: FakeClock,
) -> None:
    cache = make_cache(clock)
    store(cache, ALICE, toks(1, 2))
    clock.now += 60
    store(cache, ALICE, toks(3, 4))
    store(cache, BOB, toks(1, 2))
    assert evict_where(cache, owner="alice", idle_s=30) == {"device": BLOCK_BYTES}
    assert cache.lookup(ALICE, toks(3, 4)).num_blocks == 1
    with cache.acquire(BOB, toks(1, 2)):
        assert evict_where(cache, owner="bob") == {}
    assert evict_where(cache, owner="bob") == {"device": BLOCK_BYTES}
    cache.check_invariants()


def test_admin_evicts_pinned_blocks_a_policy_would_keep(clock: FakeClock) -> None:
    cache = make_cache(clock)
    admin = CacheAdmin(cache, keys=KEYS)
    store(cache, ALICE, toks(1, 2, 3, 4))
    assert admin.set_pinned(PromptInput(token_ids=[1, 2, 3, 4]), Scope.of_tenant("alice"),
                            True) == 2
    assert cache.evict("device", 10**6).victims == ()
    assert admin.list_prefixes(tenant="alice", limit=10)[0].is_pinned
    result = admin.evict(tenant="alice")
    assert (result.num_blocks, result.bytes_by_tier) == (2, {"device": 2 * BLOCK_BYTES})


def test_admin_evicts_by_prefix_text_in_the_tenants_namespace(clock: FakeClock) -> None:
    cache = make_cache(clock)
    admin = CacheAdmin(cache, keys=KEYS)
    text = "abcdef"
    tokens = KEYS.prompt_tokens(PromptInput(prompt=text))
    store(cache, ALICE, tokens)
    store(cache, BOB, tokens)
    assert admin.evict(tenant="alice", prefix_text=text).num_blocks == 3
    assert cache.lookup(BOB, tokens).num_blocks == 3
    assert admin.list_prefixes(tenant="bob", limit=5)[0].preview == ",".join(
        str(int(t)) for t in tokens[:BLOCK])


def lock_is_free(cache: PrefixCache) -> bool:
    """Whether another thread can take the cache's lock (the one every request's lease needs)
    now; it waits up to 10 s for it, so a lock held by the caller reads False."""
    taken = threading.Event()

    def take() -> None:
        with cache.placement.locked():
            taken.set()

    threading.Thread(target=take, daemon=True).start()
    return taken.wait(10.0)


def test_a_prefix_is_tokenised_and_its_keys_hashed_with_the_cache_lock_free(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = make_cache(clock)
    text = "abcdef"
    store(cache, ALICE, KEYS.prompt_tokens(PromptInput(prompt=text)))
    probes: list[tuple[str, bool]] = []

    class ProbingKeys(FakeKeys):
        def prompt_tokens(self, prompt: PromptInput) -> TokenIds:
            probes.append(("tokenise", lock_is_free(cache)))
            return super().prompt_tokens(prompt)

    block_keys = BlockFingerprinter.block_keys

    def probing_block_keys(self: BlockFingerprinter, tokens: TokenIds,
                           **kwargs: object) -> list[BlockKey]:
        probes.append(("hash", lock_is_free(cache)))
        return block_keys(self, tokens, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(BlockFingerprinter, "block_keys", probing_block_keys)
    assert CacheAdmin(cache, keys=ProbingKeys()).evict(tenant="alice",
                                                       prefix_text=text).num_blocks == 3
    # The chat rendering (refused: no template), the raw one, and its chain of keys.
    assert probes == [("tokenise", True), ("tokenise", True), ("hash", True)]


@pytest.mark.parametrize(
    ("criteria", "message"),
    [
        ({}, "say what to evict"),
        ({"tier": "floppy"}, "unknown tier"),
        ({"older_than_s": -1.0}, "older_than_s"),
        ({"key_hex": "not hex"}, "hex"),
        ({"prefix_text": "abc"}, "needs the tenant"),
    ],
)
def test_admin_eviction_refuses_what_it_cannot_do(
    clock: FakeClock, criteria: dict[str, object], message: str
) -> None:
    admin = CacheAdmin(make_cache(clock), keys=KEYS)
    with pytest.raises(InvalidRequest, match=message):
        admin.evict(**criteria)  # type: ignore[arg-type]


@pytest.mark.parametrize("event", [EvictionEvent(key_hex="not hex"),
                                   EvictionEvent(tier="nvme")])
def test_another_replicas_event_that_does_not_apply_here_is_skipped(
    clock: FakeClock, event: EvictionEvent,
) -> None:
    cache = make_cache(clock)
    store(cache, ALICE, toks(1, 2, 3, 4))
    CacheAdmin(cache, keys=KEYS).apply_event(event)  # no exception: the feed's reader goes on
    assert cache.stats().num_blocks == 2


def test_a_negative_quota_is_refused_and_a_quota_binds(clock: FakeClock) -> None:
    cache = make_cache(clock)
    admin = CacheAdmin(cache, keys=KEYS)
    with pytest.raises(InvalidRequest, match="quota"):
        admin.set_quota("alice", -1)
    admin.set_quota("alice", BLOCK_BYTES)
    with cache.acquire(ALICE, toks(1, 2, 3, 4)) as lease:
        result = cache.insert(lease, tier="device", block_bytes=BLOCK_BYTES)
    assert (result.num_new_blocks, result.num_refused_blocks) == (1, 1)


def test_flush_empties_every_tier(clock: FakeClock) -> None:
    cache = make_cache(clock)
    store(cache, ALICE, toks(1, 2, 3, 4))
    store(cache, BOB, toks(5, 6))
    assert CacheAdmin(cache, keys=KEYS).flush().num_blocks == 3
    assert cache.stats().num_blocks == 0
