"""Parity: a warm request equals a cold one, greedy tokens exactly and K/V bit for bit, from
every tier (docs/design.md, "Parity").

For every parity prompt (``tests.gateway.engine.parity``) and every tier -- device; host (the
blocks demoted there, held by host and not by device when served); disk after a restart (a new
cache and engine over the same directory); Redis written by another process -- a warm request:
  * generates the cold run's token ids and text (the oracle: the same engine with no_cache);
  * is served exactly its servable blocks (all full blocks before the one holding the last
    prompt token), every one from that tier, as its ``Usage.cached_tokens_by_tier`` says;
  * is handed K/V equal, layer by layer, to a cold block-aligned prefill (``torch.equal``).

The tests of one tier share an engine (each start probes invariance), started again only when a
test needs a prompt's blocks untouched and the current engine has moved them
(``tests.gateway.engine.shared_engine``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.engine.engine import Engine
from gateway.engine.models.loading import LoadedModel
from tests.gateway.engine.parity import (
    BLOCK,
    PARITY_PROMPTS,
    PROMPT_BY_ID,
    PROMPT_IDS,
    SECRET,
    ServedSpy,
    assert_blocks_equal,
    cache_config,
    cold_blocks,
    load_tiny_as_served,
    make_engine,
    model_device,
    num_servable_tokens,
    prompt_tokens,
    run,
)
from tests.gateway.engine.shared_engine import SharedEngine
from tests.redis_harness import RedisServer
from tests.tiny_llama import save_tiny_llama
from tiers.copy_fence import CopyFence
from tiers.layer_arrivals import LayerArrivals, SlabRun

ROOT = Path(__file__).resolve().parents[3]

# Prompts with at least one full block before the one holding their last token.
SERVABLE = ["repeated-sentence", "unicode", "shared-system-prompt-1", "shared-system-prompt-2",
            "multi-turn-chat", "exactly-3-blocks", "over-4-blocks", "one-letter-repeated",
            "crlf-lines", "chat-with-numbers"]
UNSERVABLE = ["shorter-than-a-block-text", "shorter-than-a-block-ids"]


def test_every_parity_prompt_is_checked() -> None:
    assert sorted(SERVABLE + UNSERVABLE) == sorted(PROMPT_IDS)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def tiny(tiny_dir: Path, request: pytest.FixtureRequest) -> LoadedModel:
    """The tiny Llama on each device: the whole suite runs on the CPU, and on CUDA where
    there is a GPU (``make test-gpu``), with the device tier beside the model."""
    return load_tiny_as_served(str(tiny_dir), request.param)


def open_tiers(tiny: LoadedModel, root: Path, **overrides: object) -> OpenedCache:
    return open_cache(cache_config(root, **overrides), layout=tiny.layout,
                      deployment_secret=SECRET, device=model_device(tiny))


def shared_without_disk(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory,
                        name: str, **overrides: object) -> Iterator[SharedEngine]:
    """Device and host tiers, no disk: one engine (restarted when needed) for a module's tests
    of one tier."""
    shared = SharedEngine(
        lambda: start_shared(tiny, tmp_path_factory.mktemp(name), disk_bytes=0, **overrides),
        block_tokens=BLOCK)
    yield shared
    shared.close()


@pytest.fixture(scope="module")
def device_engines(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[SharedEngine]:
    yield from shared_without_disk(tiny, tmp_path_factory, "device")


@pytest.fixture(scope="module")
def host_engines(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[SharedEngine]:
    yield from shared_without_disk(tiny, tmp_path_factory, "host")


@pytest.fixture(scope="module")
def layered_host_engines(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory
                         ) -> Iterator[SharedEngine]:
    """Host hits copied into their pages layer by layer (``tiers.layer_arrivals``)."""
    yield from shared_without_disk(tiny, tmp_path_factory, "layered", layered_host_loads=True)


def start_shared(tiny: LoadedModel, root: Path, **overrides: object
                 ) -> tuple[Engine, OpenedCache]:
    cache = open_tiers(tiny, root, **overrides)
    try:
        return make_engine(tiny, cache), cache
    except BaseException:
        cache.close()
        raise


def recovered_blocks(engine: Engine, opened: OpenedCache) -> None:
    assert opened.num_recovered_blocks > 0


def tier_blocks(opened: OpenedCache, tier: str) -> int:
    return next(t.num_blocks for t in opened.cache.stats().tiers if t.name == tier)


@pytest.fixture
def stack(tiny: LoadedModel) -> Iterator[list[tuple[Engine, OpenedCache]]]:
    """Engines and caches a test opens; stopped and closed when it ends."""
    opened: list[tuple[Engine, OpenedCache]] = []
    yield opened
    for engine, cache in reversed(opened):
        engine.stop(grace_s=5)
        cache.close()


def start(tiny: LoadedModel, stack: list[tuple[Engine, OpenedCache]], root: Path,
          **overrides: object) -> tuple[Engine, OpenedCache]:
    cache = open_tiers(tiny, root, **overrides)
    engine = make_engine(tiny, cache)
    stack.append((engine, cache))
    return engine, cache


def assert_warm_equals_cold(
    tiny: LoadedModel, engine: Engine, spy: ServedSpy, prompt: PromptInput,
    cold: tuple[list[int], str], *, tier: str, held_by: tuple[str, ...] | None,
    route: str = "batched",
) -> None:
    """Run ``prompt`` warm through ``engine`` and check it against the cold run ``cold``.

    ``held_by``: the tiers that must hold every served block when it is served (None: the
    blocks are not in the local index at all, i.e. they come from Redis).
    """
    tokens = prompt_tokens(tiny, prompt)
    num_blocks = num_servable_tokens(len(tokens)) // BLOCK
    assert num_blocks >= 1
    ids, text, usage = run(engine, prompt)
    served = spy.only
    assert (ids, text) == cold
    assert usage.cached_tokens == num_blocks * BLOCK
    assert usage.cached_tokens_by_tier == {tier: num_blocks * BLOCK}
    assert served.tiers == (tier,) * num_blocks
    if held_by is None:
        assert served.tiers_before == []
    else:
        assert served.tiers_before[:num_blocks] == [held_by] * num_blocks
    assert_blocks_equal(served.blocks, cold_blocks(tiny, tokens, num_blocks, route=route))


@pytest.mark.parametrize("name", SERVABLE)
def test_served_from_the_device_tier_equals_cold(
    tiny: LoadedModel, device_engines: SharedEngine, monkeypatch: pytest.MonkeyPatch, name: str,
) -> None:
    prompt = PROMPT_BY_ID[name]
    engine, opened = device_engines.any(prompt_tokens(tiny, prompt))
    run(engine, prompt)
    cold = run(engine, prompt, no_cache=True)[:2]  # queued behind it: its blocks are stored
    spy = ServedSpy(opened.cache).install(monkeypatch)
    assert_warm_equals_cold(tiny, engine, spy, prompt, cold, tier="device", held_by=("device",))


@pytest.mark.parametrize("name", SERVABLE)
def test_served_from_the_host_tier_after_demotion_equals_cold(
    tiny: LoadedModel, host_engines: SharedEngine, monkeypatch: pytest.MonkeyPatch, name: str,
) -> None:
    assert_host_hit_equals_cold(tiny, host_engines, monkeypatch, PROMPT_BY_ID[name])


@pytest.mark.parametrize("name", SERVABLE)
def test_served_from_the_host_tier_layer_by_layer_equals_cold(
    tiny: LoadedModel, layered_host_engines: SharedEngine, monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    filled: list[int] = []
    fill = LayerArrivals.fill

    def counted(self: LayerArrivals, runs: Sequence[SlabRun]) -> CopyFence | None:
        filled.append(sum(len(run.slots) for run in runs))
        return fill(self, runs)

    monkeypatch.setattr(LayerArrivals, "fill", counted)
    prompt = PROMPT_BY_ID[name]
    assert_host_hit_equals_cold(tiny, layered_host_engines, monkeypatch, prompt,
                                before_warm=filled.clear)
    num_blocks = num_servable_tokens(len(prompt_tokens(tiny, prompt))) // BLOCK
    assert sum(filled) == num_blocks  # every block the warm run read arrived by layer


def assert_host_hit_equals_cold(tiny: LoadedModel, engines: SharedEngine,
                                monkeypatch: pytest.MonkeyPatch, prompt: PromptInput, *,
                                before_warm: Callable[[], object] | None = None) -> None:
    """Run ``prompt`` cold, demote its blocks to the host tier, and serve it from there
    (``before_warm`` called just before)."""
    engine, opened = engines.any(prompt_tokens(tiny, prompt))
    run(engine, prompt)
    cold = run(engine, prompt, no_cache=True)[:2]  # queued behind it: its blocks are stored
    num_stored = opened.cache.stats().num_blocks
    num_in_device = tier_blocks(opened, "device")
    evicted = opened.cache.evict("device", 10**12)
    assert len(evicted.victims) == num_in_device > 0  # every block left device ...
    assert tier_blocks(opened, "device") == 0
    assert opened.cache.stats().num_blocks == num_stored  # ... for host, none was dropped
    spy = ServedSpy(opened.cache).install(monkeypatch)
    if before_warm is not None:
        before_warm()
    assert_warm_equals_cold(tiny, engine, spy, prompt, cold, tier="host", held_by=("host",))


@pytest.fixture(scope="module")
def written_to_disk(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[Path, dict[str, tuple[list[int], str]]]:
    """Every servable prompt run once by one engine over a disk directory (then stopped), and
    each one's cold output from that engine."""
    root = tmp_path_factory.mktemp("written")
    opened = open_tiers(tiny, root)
    engine = make_engine(tiny, opened)
    colds: dict[str, tuple[list[int], str]] = {}
    try:
        for name in SERVABLE:
            run(engine, PROMPT_BY_ID[name])
            ids, text, _ = run(engine, PROMPT_BY_ID[name], no_cache=True)
            colds[name] = (ids, text)
    finally:
        engine.stop(grace_s=5)
        opened.close()
    return root, colds


@pytest.fixture(scope="module")
def disk_restarts(tiny: LoadedModel, written_to_disk: tuple[Path, dict[str, object]]
                  ) -> Iterator[SharedEngine]:
    """New caches and engines over the directory ``written_to_disk`` left."""
    root, _ = written_to_disk
    shared = SharedEngine(lambda: start_shared(tiny, root), block_tokens=BLOCK,
                          on_start=recovered_blocks)
    yield shared
    shared.close()


@pytest.mark.parametrize("name", SERVABLE)
def test_served_from_the_disk_tier_after_a_restart_equals_cold(
    tiny: LoadedModel, written_to_disk: tuple[Path, dict[str, tuple[list[int], str]]],
    disk_restarts: SharedEngine, monkeypatch: pytest.MonkeyPatch, name: str,
) -> None:
    prompt = PROMPT_BY_ID[name]
    cold = written_to_disk[1][name]
    # a new cache over the disk directory, which has not run a prompt sharing a block with it
    engine, opened = disk_restarts.untouched(prompt_tokens(tiny, prompt))
    spy = ServedSpy(opened.cache).install(monkeypatch)
    assert_warm_equals_cold(tiny, engine, spy, prompt, cold, tier="disk", held_by=("disk",))


@pytest.fixture(scope="module")
def redis_written_by_another_process(
    tiny_dir: Path, tiny: LoadedModel, module_redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, list[int]]:
    """Every parity prompt run once by ``redis_writer`` in a subprocess (on the same device:
    it is part of the blocks' namespace); its outputs by id."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.gateway.engine.redis_writer", str(tiny_dir),
         module_redis_server.url, str(tmp_path_factory.mktemp("writer")),
         str(model_device(tiny))],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    outputs: dict[str, list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(outputs) == {name for name, _ in PARITY_PROMPTS}
    return outputs


@pytest.fixture(scope="module")
def redis_readers(tiny: LoadedModel, module_redis_server: RedisServer,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedEngine]:
    """Engines over fresh device and host tiers reading the module's Redis (no disk)."""
    shared = SharedEngine(
        lambda: start_shared(tiny, tmp_path_factory.mktemp("reader"), disk_bytes=0,
                             redis_url=module_redis_server.url),
        block_tokens=BLOCK)
    yield shared
    shared.close()


@pytest.mark.parametrize("name", SERVABLE)
def test_served_from_redis_written_by_another_process_equals_cold(
    tiny: LoadedModel, redis_readers: SharedEngine, monkeypatch: pytest.MonkeyPatch,
    redis_written_by_another_process: dict[str, list[int]], name: str,
) -> None:
    prompt = PROMPT_BY_ID[name]
    # an engine that has not fetched (into its own tiers) a block of this prompt
    engine, opened = redis_readers.untouched(prompt_tokens(tiny, prompt))
    cold = run(engine, prompt, no_cache=True)[:2]
    assert redis_written_by_another_process[name] == cold[0]  # the writer generated cold too
    spy = ServedSpy(opened.cache).install(monkeypatch)
    assert_warm_equals_cold(tiny, engine, spy, prompt, cold, tier="redis", held_by=None)


@pytest.mark.parametrize("name", UNSERVABLE)
def test_a_prompt_without_a_full_block_before_its_last_token_is_served_nothing(
    tiny: LoadedModel, stack: list[tuple[Engine, OpenedCache]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, name: str,
) -> None:
    prompt = PROMPT_BY_ID[name]
    assert num_servable_tokens(len(prompt_tokens(tiny, prompt))) == 0
    engine, opened = start(tiny, stack, tmp_path)
    run(engine, prompt)
    cold = run(engine, prompt, no_cache=True)[:2]  # queued behind it: its blocks are stored
    spy = ServedSpy(opened.cache).install(monkeypatch)
    ids, text, usage = run(engine, prompt)
    assert (ids, text) == cold
    assert usage.cached_tokens == 0 and usage.cached_tokens_by_tier == {}
    assert spy.only.blocks == []


def test_a_second_question_under_the_same_system_prompt_is_served_the_shared_blocks(
    tiny: LoadedModel, stack: list[tuple[Engine, OpenedCache]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = PROMPT_BY_ID["shared-system-prompt-1"], PROMPT_BY_ID["shared-system-prompt-2"]
    a, b = prompt_tokens(tiny, first), prompt_tokens(tiny, second)
    num_shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) // BLOCK
    assert num_shared >= 3
    engine, opened = start(tiny, stack, tmp_path)
    run(engine, first)
    cold = run(engine, second, no_cache=True)[:2]
    spy = ServedSpy(opened.cache).install(monkeypatch)
    ids, text, usage = run(engine, second)
    assert (ids, text) == cold
    assert usage.cached_tokens_by_tier == {"device": num_shared * BLOCK}
    assert spy.only.tiers == ("device",) * num_shared
    assert_blocks_equal(spy.only.blocks, cold_blocks(tiny, b, num_shared))


@pytest.mark.parametrize("name", ["shared-system-prompt-1", "multi-turn-chat", "unicode",
                                  "over-4-blocks"])
def test_the_serial_route_keeps_parity_from_device_and_from_disk(
    tiny: LoadedModel, stack: list[tuple[Engine, OpenedCache]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, name: str,
) -> None:
    """With invariance forced off (``route = serial``) warm still equals cold, bit for bit."""
    prompt = PROMPT_BY_ID[name]
    first_cache = open_tiers(tiny, tmp_path)
    first = make_engine(tiny, first_cache, route="serial")
    try:
        assert first.route.name == "serial"
        run(first, prompt)
        cold = run(first, prompt, no_cache=True)[:2]
        with monkeypatch.context() as patch:
            spy = ServedSpy(first_cache.cache).install(patch)
            assert_warm_equals_cold(tiny, first, spy, prompt, cold, tier="device",
                                    held_by=("device", "disk"), route="serial")
    finally:
        first.stop(grace_s=5)
        first_cache.close()
    opened = open_tiers(tiny, tmp_path)
    engine = make_engine(tiny, opened, route="serial")
    stack.append((engine, opened))
    spy = ServedSpy(opened.cache).install(monkeypatch)
    assert_warm_equals_cold(tiny, engine, spy, prompt, cold, tier="disk", held_by=("disk",),
                            route="serial")
