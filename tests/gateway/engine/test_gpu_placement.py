"""On a GPU the model runs where the device tier lives (issue 11, item 3): a warm hit is served
from GPU memory to a model on the GPU, with no copy back to the CPU. Marked ``gpu``
(``make test-gpu``); the whole parity suite also runs on CUDA there (``test_parity.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cache.operations.factory import open_cache
from gateway.engine.models.loading import load_model
from tests.gateway.engine.parity import (
    PROMPT_BY_ID,
    SECRET,
    cache_config,
    make_engine,
    model_device,
    run,
)
from tests.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.gpu


def test_a_warm_hit_is_served_from_gpu_memory_to_a_model_on_the_gpu(tmp_path: Path) -> None:
    tiny = load_model(str(save_tiny_llama(tmp_path / "model")), device="cuda")
    assert model_device(tiny).type == "cuda"
    opened = open_cache(cache_config(tmp_path, disk_bytes=0), layout=tiny.layout,
                        deployment_secret=SECRET, device=model_device(tiny))
    engine = make_engine(tiny, opened)
    try:
        prompt = PROMPT_BY_ID["over-4-blocks"]
        cold = run(engine, prompt, no_cache=True)[:2]
        run(engine, prompt)
        ids, text, usage = run(engine, prompt)
        assert (ids, text) == cold
        assert usage.cached_tokens_by_tier.get("device", 0) > 0
        placement = opened.cache.placement
        store = opened.hierarchy.store("device")
        with placement.locked():
            held = [store.get(placement.meta(r)) for r in placement.index.records()
                    if placement.holds(r, "device")]
        assert held and all(b is not None and b.keys[0].is_cuda for b in held)
    finally:
        engine.stop(grace_s=5)
        opened.close()
