"""Honest state through the engine (issue 11, item 4): counters and budgets say what happened,
and shutdown waits for the worker before the stores go; and an operator's ``--prefix`` matches
a system prompt as it was warmed (item 2).

A real tiny Llama, engine and cache in this process; the disk tier runs over the
fault-injecting file seam (``tests.tiers.faulty_fs``) where a test needs a slow read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import WarmRequest
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import LoadedModel, load_model
from policies.registry import TierPolicyConfig, build_tier_policy
from tests.gateway.engine.parity import BLOCK, SECRET, cache_config, make_engine, run
from tests.tiers.faulty_fs import FaultyFileOps
from tests.tiny_llama import save_tiny_llama
from tiers.codec import BlockCodec, derive_mac_key
from tiers.disk import DiskStore
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.memory import DeviceStore

PROMPT = PromptInput(token_ids=[(5 * i) % 400 for i in range(2 * BLOCK + 10)])
"""Two full blocks and 10 tokens: a 12-token answer fills a third block."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture(scope="module")
def device_only(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory,
                ) -> Iterator[tuple[Engine, OpenedCache]]:
    """One engine over a device-only cache, shared by the module's tests (distinct prompts)."""
    opened = open_cache(cache_config(tmp_path_factory.mktemp("device-only"), host_bytes=0,
                                     disk_bytes=0),
                        layout=tiny.layout, deployment_secret=SECRET)
    engine = make_engine(tiny, opened)
    yield engine, opened
    engine.stop(grace_s=2)
    opened.close()


def settled(cache: PrefixCache) -> None:
    """Wait until no request holds a block (an answer's blocks are stored after its usage)."""
    deadline = time.monotonic() + 10.0
    while cache.total_refcount():
        assert time.monotonic() < deadline, "a request kept its blocks"
        time.sleep(0.01)


def device_hits(opened: OpenedCache) -> int:
    return next(t.hits for t in opened.cache.stats().tiers if t.name == "device")


def test_a_cold_request_storing_its_blocks_counts_no_hit(
    device_only: tuple[Engine, OpenedCache],
) -> None:
    engine, opened = device_only
    hits, blocks = device_hits(opened), opened.cache.stats().num_blocks
    _, _, usage = run(engine, PROMPT)
    settled(opened.cache)
    assert usage.cached_tokens == 0
    # The prompt's 2 blocks and those its answer filled (stored as decoded: the forward's
    # decode K/V are a prefill's here); the last answer token is never fed back.
    answered = (usage.prompt_tokens + usage.completion_tokens - 1) // BLOCK
    assert engine.route.decode_kv_is_prefill_kv and answered >= 2
    assert opened.cache.stats().num_blocks == blocks + answered
    assert device_hits(opened) == hits  # looking its own blocks up to store them: no hit
    _, _, usage = run(engine, PROMPT)
    assert usage.cached_tokens == 2 * BLOCK and device_hits(opened) == hits + 1


def charged_and_held_bytes(opened: OpenedCache) -> tuple[int, int]:
    """The device tier's charged bytes, and the bytes of distinct memory it holds."""
    cache = opened.cache
    placement = cache.placement
    store = opened.hierarchy.store("device")
    storages: dict[int, int] = {}
    with placement.locked():
        for record in placement.index.records():
            if placement.holds(record, "device"):
                block = store.get(placement.meta(record))
                assert block is not None
                storages[block.keys[0].data_ptr()] = block.nbytes  # a page, or a copy of its own
    charged = next(t.used_bytes for t in cache.stats().tiers if t.name == "device")
    return charged, sum(storages.values())


def test_a_shared_block_stored_again_under_a_tenant_key_is_charged_once_per_copy(
    device_only: tuple[Engine, OpenedCache],
) -> None:
    engine, opened = device_only
    published = PromptInput(token_ids=[(3 * i) % 400 for i in range(3 * BLOCK)])
    engine.warm(WarmRequest(prompt=published, scope=Scope.shared()))
    asked = PromptInput(token_ids=[*published.token_ids, 7, 8, 9])  # type: ignore[misc]
    blocks = opened.cache.stats().num_blocks
    _, _, usage = run(engine, asked, max_tokens=2)
    settled(opened.cache)
    assert usage.cached_tokens == 3 * BLOCK  # read from the shared scope ...
    assert opened.cache.stats().num_blocks == blocks + 3  # ... and kept under the tenant's keys
    charged, held = charged_and_held_bytes(opened)
    assert charged == held  # every charged byte is memory the tier holds, once


def test_evict_by_prefix_text_matches_a_system_prompt_as_prewarm_warmed_it(
    device_only: tuple[Engine, OpenedCache],
) -> None:
    engine, opened = device_only
    system = "You are the billing assistant of Acme. Answer in one sentence. " * 3
    warmed = engine.warm(WarmRequest(  # exactly what `kvgate prewarm` sends for a text file
        prompt=PromptInput(messages=[{"role": "system", "content": system}],
                           add_generation_prompt=False),
        scope=Scope.of_tenant("alice")))
    assert warmed.num_blocks >= 2
    chat = PromptInput(messages=[{"role": "system", "content": system},
                                 {"role": "user", "content": "Where is my invoice?"}])
    _, _, usage = run(engine, chat, max_tokens=2)  # a chat under it hits the warmed blocks
    assert usage.cached_tokens == warmed.num_blocks * BLOCK
    settled(opened.cache)
    admin = CacheAdmin(opened.cache, keys=engine)
    evicted = admin.evict(tenant="alice", prefix_text=system)  # the text an operator has
    assert evicted.num_blocks >= warmed.num_blocks  # the system prompt and the chat under it
    _, _, usage = run(engine, chat, max_tokens=2)
    assert usage.cached_tokens == 0


# ---- shutdown ---------------------------------------------------------------------------


def disk_backed_cache(tiny: LoadedModel, root: Path,
                      ops: FaultyFileOps) -> tuple[PrefixCache, TierHierarchy]:
    codec = BlockCodec(mac_key=derive_mac_key(SECRET), layout=tiny.layout, block_tokens=BLOCK)
    disk = DiskStore(root / "kv", codec, fileops=ops, fsync=False)
    disk.start()
    hierarchy = TierHierarchy([TierLevel(name="device", store=DeviceStore(device="cpu")),
                               TierLevel(name="disk", store=disk)])
    slots = [TierSlot(name=name, write_through=name == "disk",
                      policy=build_tier_policy(TierPolicyConfig(budget_bytes=64 << 20)))
             for name in ("device", "disk")]
    cache = PrefixCache(tiers=slots, block_tokens=BLOCK, hierarchy=hierarchy)
    hierarchy.start()
    return cache, hierarchy


def engine_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "kvgate-engine" and t.is_alive()}


def test_stop_returns_only_once_the_worker_has_ended_so_the_stores_can_close(
    tiny: LoadedModel, tmp_path: Path,
) -> None:
    ops = FaultyFileOps()
    cache, hierarchy = disk_backed_cache(tiny, tmp_path, ops)
    before = engine_threads()
    engine = Engine(loaded=tiny, cache=cache, config=EngineConfig(block_tokens=BLOCK),
                    deployment_secret=SECRET)
    engine.start()
    (worker,) = engine_threads() - before
    try:
        run(engine, PROMPT)
        settled(cache)
        assert hierarchy.flush(timeout_s=10.0)
        cache.evict("device", 1 << 40)  # the prompt's blocks are on disk only now
        paused = ops.pause("read", path_contains=".kvb")
        outcome: list[BaseException | None] = []

        def request() -> None:
            try:
                run(engine, PROMPT)
                outcome.append(None)
            except Exception as exc:  # cancelled by the shutdown
                outcome.append(exc)

        client = threading.Thread(target=request)
        client.start()
        paused.wait_reached()  # the worker is inside a disk read, admitting the request
        release = threading.Timer(2.0, paused.release)  # a read that takes 2 s more
        release.start()
        stopped = engine.stop(grace_s=0)
        assert not worker.is_alive()  # it ended before stop returned: closing is safe now
        assert stopped
        client.join(10.0)
        assert len(outcome) == 1
        release.join()
    finally:
        ops.clear()
        engine.stop(grace_s=0)
        hierarchy.flush(timeout_s=10.0)
        hierarchy.close()
