"""A warm load, followed call by call, enters each module of the cache once (docs/architecture.md,
"How the cache core works").

The walk is recorded as it runs (``sys.setprofile``): every call into a module of
``gateway.cache`` from another module is an entry, except the calls placement makes inside its
own stay (its index, its move queue: what it decides with, under its lock) and calls on the
cache's records (a lease, a block's record, a planned read: data handed along the walk). The
load is driven by the prefix cache, whose request-path call is ``PrefixCache.load``; the
stores below (``tiers``) are not the cache's modules.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

import gateway.cache
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.errors import IndexInvariantError
from gateway.core.tokens import TokenIds, as_token_ids
from policies.registry import TierPolicyConfig, build_tier_policy
from tests.gateway.cache.test_honest_state import BLOCK, CODEC, LAYOUT, NBYTES, NS
from tests.gateway.cache.test_transfers import FlakyStore, block_for, identical
from tiers.disk import DiskStore
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore
from tiers.page_pool import PagePool

CACHE_DIR = str(Path(gateway.cache.__file__).parent) + "/"
REPO = str(Path(gateway.cache.__file__).parents[2]) + "/"
PLACEMENT = CACHE_DIR + "placement.py"
RECORDS = frozenset({"Lease", "BlockRecord", "PrefixMatch", "PlannedRead", "LoadReport",
                     "SettledLoad", "ByteMove"})
PROMPT = as_token_ids(list(range(1, 2 * 8 + 2)))  # eight full blocks and one token
Entry = tuple[str, str]  # (module file name, function)


def _module(frame: FrameType | None) -> str | None:
    """The project file a frame runs in, looking through the standard library's and the
    packages' frames (a context manager's plumbing); None if there is none."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(REPO) and "/site-packages/" not in name:
            return name
        frame = frame.f_back
    return None


def _in_placement(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_filename == PLACEMENT:
            return True
        frame = frame.f_back
    return False


@contextmanager
def recorded_walk() -> Iterator[list[Entry]]:
    """The entries into ``gateway.cache``'s modules made inside the ``with`` block."""
    entries: list[Entry] = []

    def on_event(frame: FrameType, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event != "call" or not name.startswith(CACHE_DIR):
            return
        if frame.f_code.co_qualname.split(".")[0] in RECORDS:
            return
        caller = _module(frame.f_back)
        if caller == name or (name != PLACEMENT and _in_placement(frame.f_back)):
            return
        entries.append((Path(name).name, frame.f_code.co_qualname))

    sys.setprofile(on_event)
    try:
        yield entries
    finally:
        sys.setprofile(None)


def _modules_entered_twice(entries: list[Entry]) -> dict[str, list[str]]:
    by_module: dict[str, list[str]] = {}
    for module, function in entries:
        by_module.setdefault(module, []).append(function)
    return {module: calls for module, calls in by_module.items() if len(calls) > 1}


def three_tier_cache(root: Path, wrap: Callable[[Any], Any] = lambda store: store,
                     ) -> tuple[PrefixCache, TierHierarchy]:
    """Device (a page pool), host and disk, the disk written through, as `kvgate serve` has
    them (small enough for a test)."""
    pool = PagePool(LAYOUT, page_tokens=BLOCK, num_pages=64, device="cpu")
    disk = DiskStore(root, CODEC, fsync=False)
    disk.start()
    hierarchy = TierHierarchy([
        TierLevel(name="device", store=DeviceStore(pool=pool)),
        TierLevel(name="host", store=wrap(HostStore(name=HOST, layout=LAYOUT, block_tokens=BLOCK,
                                                    budget_bytes=64 * NBYTES))),
        TierLevel(name="disk", store=wrap(disk)),
    ])
    slots = [TierSlot(name=name, write_through=name == "disk", policy=build_tier_policy(
        TierPolicyConfig(budget_bytes=64 * NBYTES))) for name in ("device", "host", "disk")]
    return PrefixCache(tiers=slots, block_tokens=BLOCK, hierarchy=hierarchy), hierarchy


def stored_in(cache: PrefixCache, hierarchy: TierHierarchy, tier: str, tokens: TokenIds) -> None:
    """Store ``tokens``' blocks, then leave them in ``tier`` and the tiers below it only."""
    with cache.acquire(NS, tokens) as lease:
        cache.insert(lease, tier="device",
                     blocks=[block_for(tokens, i) for i in range(len(lease.keys))])
    hierarchy.flush()
    for upper in cache.tier_names[:cache.tier_names.index(tier)]:
        cache.evict(upper, 10**9)
    assert set(cache.lookup(NS, tokens).tiers) == {tier}


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_a_warm_load_enters_each_cache_module_once(tmp_path: Path, tier: str) -> None:
    cache, hierarchy = three_tier_cache(tmp_path / "kv")
    try:
        stored_in(cache, hierarchy, tier, PROMPT)
        with cache.acquire(NS, PROMPT) as lease:
            with recorded_walk() as entries:
                loaded = cache.load(lease)
        assert len(loaded) == 8
        assert all(identical(b, block_for(PROMPT, i)) for i, b in enumerate(loaded))
        assert _modules_entered_twice(entries) == {}
        assert [module for module, _ in entries][:3] == [
            "prefix_cache.py", "transfers.py", "placement.py"]
        cache.check_invariants()
    finally:
        hierarchy.close()


def test_a_load_that_meets_a_bad_copy_still_settles_in_one_stay(tmp_path: Path) -> None:
    """A copy that fails verification in the host tier is read from the disk instead, with
    no lock taken between the reads; placement learns of both at once."""
    cache, hierarchy = three_tier_cache(tmp_path / "kv", wrap=FlakyStore)
    try:
        stored_in(cache, hierarchy, "host", PROMPT)
        host = hierarchy.store("host")
        with cache.acquire(NS, PROMPT) as lease:
            host.fail_keys.add(lease.keys[3])  # type: ignore[attr-defined]
            with recorded_walk() as entries:
                loaded = cache.load(lease)
        assert len(loaded) == 8
        assert all(identical(b, block_for(PROMPT, i)) for i, b in enumerate(loaded))
        assert lease.match.tiers == ("host",) * 3 + ("disk",) + ("host",) * 4
        assert _modules_entered_twice(entries) == {}
        stats = {t.name: t for t in cache.stats().tiers}
        assert stats["host"].load_failures == 1
        assert "host" not in cache.tiers_of(lease.keys[3])
        cache.check_invariants()
    finally:
        hierarchy.close()


def test_a_promotion_is_settled_at_the_next_stay_and_read_from_the_fastest_tier_then(
        tmp_path: Path) -> None:
    """The transfers post the promoted blocks' writes rather than settle them; the next
    lookup, taking the lock, settles them first and finds the blocks in the device tier."""
    cache, hierarchy = three_tier_cache(tmp_path / "kv")
    try:
        stored_in(cache, hierarchy, "host", PROMPT)
        with cache.acquire(NS, PROMPT) as lease:
            cache.load(lease)
        assert cache.lookup(NS, PROMPT).tiers == ("device",) * 8
        with cache.acquire(NS, PROMPT) as lease:
            cache.load(lease)
            assert lease.match.tiers == ("device",) * 8
        cache.check_invariants()
    finally:
        hierarchy.close()


def test_a_warm_lease_takes_the_lock_three_times_acquire_settle_release(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, hierarchy = three_tier_cache(tmp_path / "kv")
    try:
        stored_in(cache, hierarchy, "host", PROMPT)
        placement = cache.placement
        original = placement.locked
        stays: list[str] = []

        def counted() -> AbstractContextManager[None]:
            stays.append(sys._getframe(1).f_code.co_name)
            return original()

        monkeypatch.setattr(placement, "locked", counted)
        with cache.acquire(NS, PROMPT) as lease:
            assert len(cache.load(lease)) == 8
        assert stays == ["acquire", "settle_load", "_release"]
    finally:
        hierarchy.close()


def test_a_lease_loaded_twice_reads_only_the_blocks_it_still_holds(tmp_path: Path) -> None:
    """The plan is cut with the lease: a second load neither reads nor lets go of a block the
    first one let go."""
    cache, hierarchy = three_tier_cache(tmp_path / "kv")
    try:
        stored_in(cache, hierarchy, "device", PROMPT)
        with cache.acquire(NS, PROMPT) as lease:
            assert len(cache.load(lease, max_blocks=3)) == 3
            again = cache.load(lease)
            assert lease.plan is not None
            assert len(again) == 3 and len(lease.plan) == len(lease.records) == 3
            assert all(identical(b, block_for(PROMPT, i)) for i, b in enumerate(again))
        assert cache.total_refcount() == 0
        cache.check_invariants()
    finally:
        hierarchy.close()


def test_a_lease_acquired_only_to_store_after_it_is_not_planned_and_cannot_load(
        tmp_path: Path) -> None:
    cache, hierarchy = three_tier_cache(tmp_path / "kv")
    try:
        stored_in(cache, hierarchy, "device", PROMPT)
        with cache.acquire(NS, PROMPT, to_load=False) as lease:
            assert lease.plan is None and lease.match.num_blocks == 8
            with pytest.raises(IndexInvariantError, match="to_load=False"):
                cache.load(lease)
        assert cache.total_refcount() == 0
    finally:
        hierarchy.close()
