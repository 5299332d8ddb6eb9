"""Running out of memory refuses the requests it hit with RESOURCE_EXHAUSTED; the engine goes on.

Where the KV budget is set above what the device holds, an allocation can still fail (a CUDA
out-of-memory, or the CPU allocator's refusal). That must never reach a client as an internal
error nor stop the engine: the requests of that step (or that admission) get QueueFull
(RESOURCE_EXHAUSTED) saying what ran out, and the next request is served as if nothing happened.
The failure is injected at the real seam (the step's forward, a request's KV buffers).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gateway.core.canonical import PromptInput
from gateway.core.errors import QueueFull
from gateway.engine.engine import Engine
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.scheduling.loop_failures import is_out_of_memory
from tests.gateway.engine.parity import BLOCK, make_engine, run
from tests.tiny_llama import save_tiny_llama

PROMPT = PromptInput(token_ids=[(7 * i) % 400 for i in range(BLOCK + 9)])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture
def engine(tiny: LoadedModel) -> Iterator[Engine]:
    engine = make_engine(tiny, None)
    yield engine
    engine.stop(grace_s=5)


def fail_once(error: BaseException, real: Any) -> Any:
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise error
        return real(*args, **kwargs)

    return failing


def test_a_step_out_of_device_memory_refuses_its_requests_and_the_engine_goes_on(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = run(engine, PROMPT, no_cache=True)[0]
    assert engine._loop is not None
    forward = engine._loop.forward
    monkeypatch.setattr(forward, "forward", fail_once(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        forward.forward))
    with pytest.raises(QueueFull, match=r"ran out of memory for a step of 1 requests"):
        run(engine, PROMPT, no_cache=True)
    assert run(engine, PROMPT, no_cache=True)[0] == expected


def test_kv_buffers_the_cpu_cannot_allocate_refuse_that_request_only(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = run(engine, PROMPT, no_cache=True)[0]
    monkeypatch.setattr(KVSequence, "from_blocks", fail_once(
        RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate "
                     "memory: you tried to allocate 40000000000 bytes."),
        KVSequence.from_blocks))
    with pytest.raises(QueueFull, match=r"ran out of memory for this request's KV"):
        run(engine, PROMPT, no_cache=True)
    assert run(engine, PROMPT, no_cache=True)[0] == expected


def test_only_allocation_failures_count_as_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))
