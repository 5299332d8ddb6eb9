"""Fixtures shared by the gateway tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.core.tokenizer import HFTokenizerAdapter
from tests.tokenizer_fixture import make_test_tokenizer


@pytest.fixture(scope="session")
def test_tokenizer() -> HFTokenizerAdapter:
    """The small offline ChatML tokenizer (``tests.tokenizer_fixture``), built once per run."""
    return make_test_tokenizer()


@pytest.fixture(scope="session")
def bundled_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for every test that loads the bundled SmolLM2 (it converts once)."""
    return tmp_path_factory.mktemp("bundled-model-cache")
