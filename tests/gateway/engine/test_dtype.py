"""The engine in another dtype (issue 14, item 1): bfloat16 through the whole request path on
the CPU -- probe, batched or serial route, cache, warm equal to cold bit for bit -- and the dtype
in every block's namespace, so K/V of one dtype are never served to an engine of another. The
tiny Llama keeps it fast; ``auto`` on a real GPU is the test marked ``gpu`` at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.config.device import resolve_device
from gateway.config.dtype import resolve_dtype
from gateway.core.fingerprint import Scope
from gateway.core.requests import LookupRequest
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.parity import (
    ALICE,
    BLOCK,
    PROMPT_BY_ID,
    SECRET,
    ServedSpy,
    assert_blocks_equal,
    cache_config,
    cold_blocks,
    model_device,
    num_servable_tokens,
    prompt_tokens,
    run,
)
from tests.tiny_llama import save_tiny_llama

PROMPT = PROMPT_BY_ID["over-4-blocks"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny_bf16(tiny_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dir), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def tiny_fp32(tiny_dir: Path) -> LoadedModel:
    return load_model(str(tiny_dir))


@pytest.fixture
def stack() -> Iterator[list[tuple[Engine, OpenedCache]]]:
    """Engines and caches a test opens; stopped and closed when it ends."""
    opened: list[tuple[Engine, OpenedCache]] = []
    yield opened
    for engine, cache in opened:
        engine.stop(grace_s=5)
        cache.close()


def start(stack: list[tuple[Engine, OpenedCache]], loaded: LoadedModel, root: Path,
          route: str = "auto") -> tuple[Engine, OpenedCache]:
    """An engine over tiers under ``root`` (device, host, disk: a restart over the same root
    finds the blocks on disk). Either route is accepted: where the probe fails for a dtype the
    engine serves on the serial route, and warm must equal cold on both."""
    opened = open_cache(cache_config(root), layout=loaded.layout, deployment_secret=SECRET,
                        device=model_device(loaded))
    engine = Engine(loaded=loaded, cache=opened.cache, pool=opened.pool,
                    config=EngineConfig(block_tokens=BLOCK, route=route),
                    deployment_secret=SECRET)
    stack.append((engine, opened))
    engine.start()
    return engine, opened


def stop(stack: list[tuple[Engine, OpenedCache]]) -> None:
    """Stop the last engine and close its cache (pending disk writes land first)."""
    engine, opened = stack.pop()
    engine.stop(grace_s=5)
    opened.close()


@pytest.mark.parametrize("route", ["auto", "serial"])
def test_bfloat16_on_the_cpu_serves_warm_equal_to_cold_with_bfloat16_kv(
    tiny_bf16: LoadedModel, tmp_path: Path, stack: list[tuple[Engine, OpenedCache]],
    monkeypatch: pytest.MonkeyPatch, route: str,
) -> None:
    engine, opened = start(stack, tiny_bf16, tmp_path, route=route)
    assert (engine.dtype, engine.device) == ("bfloat16", "cpu")
    cold = run(engine, PROMPT, no_cache=True)[:2]
    run(engine, PROMPT)
    spy = ServedSpy(opened.cache).install(monkeypatch)
    ids, text, usage = run(engine, PROMPT)
    assert (ids, text) == cold
    num_served = num_servable_tokens(len(prompt_tokens(tiny_bf16, PROMPT)))
    assert usage.cached_tokens_by_tier == {"device": num_served}
    served = spy.only.blocks
    assert served and all(t.dtype == torch.bfloat16 for b in served for t in (*b.keys, *b.values))
    oracle = cold_blocks(tiny_bf16, prompt_tokens(tiny_bf16, PROMPT), len(served),
                         route=engine.route.name)
    assert_blocks_equal(served, oracle)


def test_one_prompt_under_two_dtypes_gets_two_namespaces_and_no_hit_across_them(
    tiny_fp32: LoadedModel, tiny_bf16: LoadedModel, tmp_path: Path,
    stack: list[tuple[Engine, OpenedCache]],
) -> None:
    fp32, _ = start(stack, tiny_fp32, tmp_path)
    cold_fp32 = run(fp32, PROMPT)[:2]
    fp32_namespace = fp32.namespace(ALICE)
    stop(stack)
    # positive control: restarted in float32, the same disk serves float32's blocks
    again, _ = start(stack, tiny_fp32, tmp_path)
    assert again.namespace(ALICE).digest == fp32_namespace.digest
    ids, text, usage = run(again, PROMPT)
    assert usage.cached_tokens_by_tier.get("disk", 0) > 0 and (ids, text) == cold_fp32
    stop(stack)
    # restarted in bfloat16 over the same disk: another namespace, and nothing of float32's
    bf16, opened = start(stack, tiny_bf16, tmp_path)
    assert bf16.namespace(ALICE).digest != fp32_namespace.digest
    assert bf16.namespace(Scope.shared()).digest != again.namespace(Scope.shared()).digest
    assert bf16.lookup(LookupRequest(prompt=PROMPT, scope=ALICE)).cached_tokens == 0
    ids, text, usage = run(bf16, PROMPT)
    assert usage.cached_tokens == 0  # computed afresh in bfloat16
    assert (ids, text) == run(bf16, PROMPT, no_cache=True)[:2]
    # the float32 files were not even adopted: their header's layout names another dtype
    [disk] = [s for s in opened.cache.stats().stores if s.name == "disk"]
    assert disk.verification_failures.get("shape", 0) > 0


@pytest.mark.gpu
def test_auto_on_a_gpu_runs_the_engine_in_bfloat16_warm_equal_to_cold(
    tiny_dir: Path, tmp_path: Path, stack: list[tuple[Engine, OpenedCache]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    assert (device.type, dtype) == ("cuda", torch.bfloat16)
    loaded = load_model(str(tiny_dir), device=device, dtype=dtype)
    engine, opened = start(stack, loaded, tmp_path)
    assert (engine.dtype, engine.device) == ("bfloat16", "cuda:0")
    cold = run(engine, PROMPT, no_cache=True)[:2]
    run(engine, PROMPT)
    spy = ServedSpy(opened.cache).install(monkeypatch)
    ids, text, usage = run(engine, PROMPT)
    assert (ids, text) == cold
    assert usage.cached_tokens_by_tier.get("device", 0) > 0
    served = spy.only.blocks
    assert served and all(t.dtype == torch.bfloat16 and t.is_cuda
                          for b in served for t in (*b.keys, *b.values))
    oracle = cold_blocks(loaded, prompt_tokens(loaded, PROMPT), len(served),
                         route=engine.route.name)
    assert_blocks_equal(served, oracle)
