"""Remembered route verdicts: a second start on the same machine skips the search, and a
verdict that was altered, made under another secret or for another key is never used.

The engine is driven with a kernels seam that counts its calls, so "the search did not run" is
observed, not timed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.linear.row_padding import RowPadding
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.engine.parity.route_search import RouteVerdict, SearchSettings
from gateway.engine.parity.verdicts import VerdictStore, verdict_key
from tests.gateway.engine.kernels import rowwise
from tests.gateway.engine.parity import SECRET
from tests.tiny_llama import save_tiny_llama

VERDICT = RouteVerdict(name="batched", reason="probed", kernel="blas",
                       padding=RowPadding(minimum=4, multiple=4, exact_from=12),
                       attention="tiled", decode_kv_is_prefill_kv=False, seconds=1.5)
MACHINE = {"torch": "2.13.0", "cpu": "Some CPU [avx2 fma]", "numerics": "2"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def _key(**changes: str) -> dict[str, str]:
    key = verdict_key(fingerprint="f" * 64, dtype=torch.float32, device=torch.device("cpu"),
                      settings=SearchSettings(), machine=MACHINE)
    return {**key, **changes}


def test_a_saved_verdict_is_loaded_for_the_same_key(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path, SECRET)
    store.save(_key(), VERDICT)
    assert store.load(_key()) == VERDICT
    assert oct(store.path_for(_key()).stat().st_mode & 0o777) == "0o600"


def test_a_verdict_keeps_the_shapes_padded_further_than_the_step(tmp_path: Path) -> None:
    verdict = RouteVerdict(name="batched", reason="probed", kernel="gemm",
                           padding=RowPadding(minimum=1, multiple=64),
                           wider=(((64, 128), RowPadding(minimum=256, multiple=64)),),
                           attention="triton", seconds=2.0)
    store = VerdictStore(tmp_path, SECRET)
    store.save(_key(), verdict)
    assert store.load(_key()) == verdict


def test_a_verdict_keeps_whether_its_weights_are_packed(tmp_path: Path) -> None:
    verdict = RouteVerdict(name="batched", reason="probed", kernel="onednn",
                           padding=RowPadding(minimum=2, multiple=8), attention="paged",
                           packed=True, seconds=2.0)
    store = VerdictStore(tmp_path, SECRET)
    store.save(_key(), verdict)
    assert store.load(_key()) == verdict


def test_another_cpu_torch_or_model_finds_no_verdict(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path, SECRET)
    store.save(_key(), VERDICT)
    for changed in ({"cpu": "Other CPU [avx512f amx_tile]"}, {"torch": "2.14.0"},
                    {"model": "e" * 64}, {"dtype": "torch.bfloat16"}):
        assert store.load(_key(**changed)) is None


def test_an_altered_verdict_is_ignored_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = VerdictStore(tmp_path, SECRET)
    store.save(_key(), VERDICT)
    path = store.path_for(_key())
    document = json.loads(path.read_text())
    document["body"] = document["body"].replace('"serial"', '"x"').replace(
        '"minimum": 4', '"minimum": 1')
    path.write_text(json.dumps(document))
    with caplog.at_level(logging.WARNING, logger="gateway.engine.parity.verdicts"):
        assert store.load(_key()) is None
    assert "tag does not match" in caplog.text


def test_a_verdict_made_under_another_secret_is_ignored(tmp_path: Path) -> None:
    VerdictStore(tmp_path, b"another secret of 32 bytes......").save(_key(), VERDICT)
    assert VerdictStore(tmp_path, SECRET).load(_key()) is None


def test_a_file_that_is_not_a_verdict_is_ignored(tmp_path: Path) -> None:
    store = VerdictStore(tmp_path, SECRET)
    store.path_for(_key()).write_text("{not json")
    assert store.load(_key()) is None


class CountingKernels(dict):  # type: ignore[type-arg]
    """Kernels that keep every row, counting how often any was called."""

    def __init__(self) -> None:
        self.calls = 0

        def counted(rows: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
            self.calls += 1
            return rowwise(rows, weight, bias)
        super().__init__(onednn=counted, blas=counted)


def _start(tiny: LoadedModel, store: VerdictStore, kernels: CountingKernels) -> Engine:
    engine = Engine(loaded=tiny, cache=None, config=EngineConfig(block_tokens=16),
                    deployment_secret=SECRET, verdicts=store, kernels=kernels)
    engine.start()
    engine.stop(grace_s=0)
    return engine


def test_a_second_start_takes_the_remembered_route_without_searching(tiny, tmp_path) -> None:
    store = VerdictStore(tmp_path / "routes", SECRET)
    first_kernels, second_kernels = CountingKernels(), CountingKernels()
    first = _start(tiny, store, first_kernels)
    searched_calls = first_kernels.calls
    second = _start(tiny, store, second_kernels)
    assert searched_calls > 0 and second_kernels.calls == 0
    assert second.route == first.route and second.route.name == "batched"
    assert list((tmp_path / "routes").iterdir()) == [
        store.path_for(verdict_key(fingerprint=tiny.fingerprint, dtype=torch.float32,
                                   device=torch.device("cpu"),
                                   settings=EngineConfig(block_tokens=16).search_settings(),
                                   walk=tiny.batched_walk))]


def test_a_cancelled_search_raises_and_remembers_nothing(tiny, tmp_path) -> None:
    from gateway.engine.parity.route_search import SearchCancelled

    store = VerdictStore(tmp_path / "routes", SECRET)
    engine = Engine(loaded=tiny, cache=None, config=EngineConfig(block_tokens=16),
                    deployment_secret=SECRET, verdicts=store, cancelled=lambda: True)
    with pytest.raises(SearchCancelled):
        engine.start()
    assert not (tmp_path / "routes").exists()
