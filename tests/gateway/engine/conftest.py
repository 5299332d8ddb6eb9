"""Fixtures most engine tests share: the tiny Llama, a cache over the test's own directory, and
an engine over both (stopped when the test ends). A module that needs another of these defines
its own fixture of the same name, which takes precedence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.engine.engine import Engine
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.parity import SECRET, cache_config, make_engine
from tests.tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture
def opened(tiny: LoadedModel, tmp_path: Path) -> Iterator[OpenedCache]:
    cache = open_cache(cache_config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    yield cache
    cache.close()


@pytest.fixture
def engine(tiny: LoadedModel, opened: OpenedCache) -> Iterator[Engine]:
    e = make_engine(tiny, opened)
    yield e
    e.stop(grace_s=5)
