"""The transfers: a prefix cache carrying bytes -- loads, promotion, demotion, failed loads,
the load-or-recompute choice, and pressure across tiers (``gateway.cache.transfers``)."""

from __future__ import annotations

import random
import threading
from contextlib import AbstractContextManager

import pytest
import torch

from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.admin_reports import StoreReport
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from policies.base import BlockKey
from policies.registry import TierPolicyConfig, build_tier_policy
from tiers.base import BatchDefaults, BlockMeta
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore
from tiers.payload import KVBlock, KVLayout

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
BLOCK = 2
NBYTES = LAYOUT.block_nbytes(BLOCK)
NS = derive_namespace(
    NamespaceSpec(
        deployment_secret=b"k" * 32,
        model_fingerprint="tiny",
        kv_dtype="float32",
        device_kind="cpu",
        scope=Scope.of_tenant("a"),
    )
)


def block_for(tokens: TokenIds, index: int) -> KVBlock:
    """A deterministic payload derived from a block's tokens (what a model would compute)."""
    seed = int(sum(int(t) * 31**i for i, t in enumerate(tokens[: (index + 1) * BLOCK])))
    g = torch.Generator().manual_seed(seed % (2**31))
    shape = (LAYOUT.kv_heads, BLOCK, LAYOUT.head_dim)
    return KVBlock(
        keys=tuple(torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)),
        values=tuple(torch.randn(shape, generator=g) for _ in range(LAYOUT.num_layers)),
    )


def identical(a: KVBlock, b: KVBlock) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True)
    )


class FlakyStore(BatchDefaults):
    """Wraps a store; the copies under ``fail_keys`` are bad: reading one is a failed
    verification (a miss, and the bad copy is deleted, as a real store does)."""

    def __init__(self, inner: DeviceStore | HostStore) -> None:
        self.inner = inner
        self.name = inner.name
        self.fail_keys: set[BlockKey] = set()

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        self.inner.put(meta, block)

    def get(self, meta: BlockMeta) -> KVBlock | None:
        if meta.key in self.fail_keys:
            self.fail_keys.discard(meta.key)
            self.inner.delete(meta.key)
            return None
        return self.inner.get(meta)

    def delete(self, key: BlockKey) -> None:
        self.inner.delete(key)

    def contains(self, key: BlockKey) -> bool:
        return self.inner.contains(key)

    def stats(self) -> StoreReport:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


class LockWatchingStore(FlakyStore):
    """Records, for every read and write of its store, whether the cache's lock was held then
    (the cache is set after it is built); a real store underneath."""

    def __init__(self, inner: DeviceStore | HostStore) -> None:
        super().__init__(inner)
        self.cache: PrefixCache | None = None
        self.num_calls = 0
        self.num_under_lock = 0

    def _watch(self) -> None:
        if self.cache is None:
            return
        self.num_calls += 1
        got = threading.Event()

        def probe() -> None:  # another thread: it gets the lock at once unless someone has it
            with self.cache.placement.locked():  # type: ignore[union-attr]
                got.set()

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        if not got.wait(timeout=0.5):
            self.num_under_lock += 1
        prober.join(timeout=5)

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        self._watch()
        super().put(meta, block)

    def get(self, meta: BlockMeta) -> KVBlock | None:
        self._watch()
        return super().get(meta)


def make_cache(device_blocks: int, host_blocks: int,
               wrap: type[FlakyStore] = FlakyStore) -> tuple[PrefixCache, FlakyStore, FlakyStore]:
    device = wrap(DeviceStore(device="cpu"))
    host = wrap(HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK,
                          budget_bytes=host_blocks * NBYTES))
    hierarchy = TierHierarchy(
        [TierLevel(name="device", store=device), TierLevel(name="host", store=host)]
    )
    slots = [
        TierSlot(name="device", policy=build_tier_policy(
            TierPolicyConfig(budget_bytes=device_blocks * NBYTES))),
        TierSlot(name="host", policy=build_tier_policy(
            TierPolicyConfig(budget_bytes=host_blocks * NBYTES))),
    ]
    cache = PrefixCache(tiers=slots, block_tokens=BLOCK, hierarchy=hierarchy)
    return cache, device, host


def serve(cache: PrefixCache, tokens: TokenIds) -> tuple[int, tuple[str, ...]]:
    """What a request does: load its cached prefix, check it, store the rest."""
    with cache.acquire(NS, tokens) as lease:
        loaded = cache.load(lease)
        expected = [block_for(tokens, i) for i in range(len(loaded))]
        assert all(identical(a, b) for a, b in zip(loaded, expected, strict=True))
        start = lease.match.num_blocks
        fresh = [block_for(tokens, i) for i in range(start, len(lease.keys))]
        cache.insert(lease, tier="device", blocks=fresh)
        return lease.match.num_blocks, lease.match.tiers


def toks(*ids: int) -> TokenIds:
    return as_token_ids(list(ids))


def test_a_stored_prefix_loads_bit_identical_from_the_device_tier() -> None:
    cache, _, _ = make_cache(8, 8)
    prompt = toks(1, 2, 3, 4, 5)
    assert serve(cache, prompt) == (0, ())
    assert serve(cache, prompt) == (2, ("device", "device"))


def test_device_evictions_demote_to_host_and_hits_promote_back() -> None:
    cache, _, _ = make_cache(2, 8)
    first, second = toks(1, 1, 2, 2), toks(3, 3, 4, 4)
    serve(cache, first)
    serve(cache, second)  # device full: the first prompt's blocks move to host
    assert cache.tiers_of(cache.lookup(NS, first).keys[0]) == ("host",)
    assert serve(cache, first) == (2, ("host", "host"))
    assert cache.tiers_of(cache.lookup(NS, first).keys[0]) == ("device", "host")
    stats = {t.name: t for t in cache.stats().tiers}
    assert stats["device"].demotions >= 2
    assert (stats["device"].promotions, stats["host"].promotions) == (2, 0)  # where they went
    cache.check_invariants()


def test_no_byte_is_read_or_written_under_the_cache_lock() -> None:
    cache, device, host = make_cache(2, 8, wrap=LockWatchingStore)
    assert isinstance(device, LockWatchingStore) and isinstance(host, LockWatchingStore)
    device.cache = host.cache = cache
    first, second = toks(1, 1, 2, 2), toks(3, 3, 4, 4)
    serve(cache, first)
    serve(cache, second)  # an insert whose room is made by demoting the first prompt
    cache.evict("device", 2 * NBYTES)  # an operator's eviction, demoting the second
    assert {t.name: t.demotions for t in cache.stats().tiers} == {"device": 4, "host": 0}
    # Their demoted copies serve, bit-identical, and are promoted back.
    assert serve(cache, first) == (2, ("host", "host"))
    assert serve(cache, second) == (2, ("host", "host"))
    assert device.num_calls > 0 and host.num_calls > 0
    assert (device.num_under_lock, host.num_under_lock) == (0, 0)
    cache.check_invariants()
    assert cache.total_refcount() == 0


class StallingStore(FlakyStore):
    """Once armed, its next write waits (``entered`` set) until ``release`` is set."""

    def __init__(self, inner: DeviceStore | HostStore) -> None:
        super().__init__(inner)
        self.is_armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def put(self, meta: BlockMeta, block: KVBlock) -> None:
        if self.is_armed:
            self.is_armed = False
            self.entered.set()
            assert self.release.wait(timeout=10)
        super().put(meta, block)


def test_a_block_whose_demotion_has_not_landed_is_a_clean_miss() -> None:
    cache, _, host = make_cache(2, 8, wrap=StallingStore)
    assert isinstance(host, StallingStore)
    first, second = toks(1, 1, 2, 2), toks(3, 3, 4, 4)
    serve(cache, first)
    host.is_armed = True  # the first prompt's demotion will stall in host's write
    inserting = threading.Thread(target=serve, args=(cache, second))
    inserting.start()
    try:
        assert host.entered.wait(timeout=10)
        # The lock is free while bytes move; the copies not landed yet are not read.
        with cache.acquire(NS, first) as lease:
            assert cache.load(lease) == []
    finally:
        host.release.set()
        inserting.join(timeout=10)
    assert {t.name: t.load_failures for t in cache.stats().tiers} == {"device": 0, "host": 0}
    assert serve(cache, first) == (2, ("host", "host"))  # landed: served from there
    cache.check_invariants()
    assert cache.total_refcount() == 0


def test_a_block_that_fails_verification_cuts_the_prefix_there() -> None:
    cache, device, _ = make_cache(8, 8)
    prompt = toks(1, 2, 3, 4, 5, 6)
    serve(cache, prompt)
    keys = cache.lookup(NS, prompt).keys
    device.fail_keys.add(keys[1])
    assert serve(cache, prompt)[0] == 1  # block 1 recomputed and stored again
    assert serve(cache, prompt)[0] == 3
    assert {t.name: t for t in cache.stats().tiers}["device"].load_failures == 1
    cache.check_invariants()


def test_a_failed_load_falls_back_to_a_slower_copy() -> None:
    cache, device, _ = make_cache(2, 8)
    prompt = toks(1, 1, 2, 2)
    serve(cache, prompt)
    serve(cache, toks(3, 3, 4, 4))  # demote the first prompt
    serve(cache, prompt)  # promote it back: now on device and host
    device.fail_keys.update(cache.lookup(NS, prompt).keys)
    assert serve(cache, prompt) == (2, ("host", "host"))


def test_recomputing_is_chosen_when_loading_is_estimated_slower() -> None:
    cache, _, _ = make_cache(8, 8)
    prompt = toks(1, 2, 3, 4)
    serve(cache, prompt)
    serve(cache, prompt)  # one timed load gives the device tier a bandwidth estimate
    with cache.acquire(NS, prompt) as lease:
        assert cache.load(lease, recompute_s_per_token=0.0) == []
        assert lease.match.num_blocks == 0
    assert {t.name: t for t in cache.stats().tiers}["device"].recomputed_instead == 1
    assert cache.total_refcount() == 0


def test_a_parent_never_leaves_the_last_tier_before_its_children() -> None:
    cache, _, _ = make_cache(1, 2)
    serve(cache, toks(1, 1, 2, 2, 3, 3))
    for _ in range(3):
        serve(cache, toks(9, 9))
    cache.check_invariants()
    match = cache.lookup(NS, toks(1, 1, 2, 2, 3, 3))
    for i, key in enumerate(match.keys):
        assert cache.tiers_of(key), f"block {i} has no tier"


def test_inserting_without_payloads_into_a_byte_carrying_cache_is_refused() -> None:
    cache, _, _ = make_cache(2, 2)
    with cache.acquire(NS, toks(1, 2)) as lease, pytest.raises(ValueError, match="blocks"):
        cache.insert(lease, tier="device", block_bytes=NBYTES)


def test_eviction_pressure_from_many_threads_keeps_every_invariant() -> None:
    cache, _, _ = make_cache(3, 6)
    prompts = [toks(*[random.Random(i).randrange(4) for _ in range(8)]) for i in range(24)]
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            start.wait(timeout=10)
            for _ in range(60):
                serve(cache, rng.choice(prompts))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[0]
    cache.check_invariants()
    assert cache.total_refcount() == 0
    stats = {t.name: t for t in cache.stats().tiers}
    assert stats["device"].used_bytes <= 3 * NBYTES
    assert stats["host"].used_bytes <= 6 * NBYTES


def test_load_needs_a_byte_carrying_cache() -> None:
    slots = [TierSlot(name="device", policy=build_tier_policy(TierPolicyConfig(budget_bytes=99)))]
    cache = PrefixCache(tiers=slots, block_tokens=BLOCK)
    with cache.acquire(NS, toks(1, 2)) as lease, pytest.raises(ValueError, match="carries bytes"):
        cache.load(lease)




def test_stats_report_every_tier_and_every_store() -> None:
    cache, _, _ = make_cache(2, 8)
    serve(cache, toks(1, 1, 2, 2))
    serve(cache, toks(3, 3, 4, 4))
    stats = cache.stats()
    assert [t.name for t in stats.tiers] == ["device", "host"]
    assert [s.name for s in stats.stores] == ["device", "host"]
    by_name = {s.name: s for s in stats.stores}
    assert by_name["host"].num_blocks == 2
    assert by_name["device"].num_bytes == 2 * NBYTES


def test_a_warm_load_takes_the_lock_once_whatever_the_chain_length(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain was planned when its lease was acquired; its reads take no lock, and
    placement settles what they brought in one stay, for eight blocks as for two."""
    def lock_entries(num_blocks: int) -> int:
        cache, _, _ = make_cache(64, 64)
        prompt = toks(*range(1, 2 * num_blocks + 2))
        serve(cache, prompt)
        cache.evict("device", 10**9)  # every block now in the host tier only
        entries = [0]
        original = cache.placement.locked

        def counting() -> AbstractContextManager[None]:
            entries[0] += 1
            return original()

        with cache.acquire(NS, prompt) as lease:
            monkeypatch.setattr(cache.placement, "locked", counting)
            loaded = cache.load(lease)
            monkeypatch.undo()
        assert len(loaded) == num_blocks
        return entries[0]

    assert lock_entries(8) == lock_entries(2) == 1


class MeetingStore(FlakyStore):
    """Each read waits until ``readers`` reads are in flight at once (or fails the test)."""

    def __init__(self, inner: DeviceStore | HostStore, readers: int) -> None:
        super().__init__(inner)
        self.meeting = threading.Barrier(readers, timeout=10)

    def get(self, meta: BlockMeta) -> KVBlock | None:
        self.meeting.wait()
        return super().get(meta)


def test_a_tier_with_parallel_reads_reads_a_runs_blocks_at_once_and_returns_them_in_order(
        ) -> None:
    store = MeetingStore(HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK,
                                   budget_bytes=64 * NBYTES), readers=2)
    hierarchy = TierHierarchy([TierLevel(name="disk", store=store, parallel_reads=2)])
    prompt = toks(1, 2, 3, 4, 5)
    metas = [BlockMeta(key=BlockKey(bytes([i]) * 16), parent_key=BlockKey(b"\0" * 16),
                       namespace_digest=NS.digest, owner="a", tokens=b"") for i in (1, 2)]
    for index, meta in enumerate(metas):
        store.inner.put(meta, block_for(prompt, index))
    try:
        got = hierarchy.read_many("disk", metas)
    finally:
        hierarchy.close()
    assert all(block is not None and identical(block, block_for(prompt, i))
               for i, block in enumerate(got))
