"""Fixtures shared by the gateway tests."""

from __future__ import annotations

import pytest

from gateway.tokenizer import HFTokenizerAdapter
from tests.tokenizer_fixture import make_test_tokenizer


@pytest.fixture(scope="session")
def test_tokenizer() -> HFTokenizerAdapter:
    """The small offline ChatML tokenizer (``tests.tokenizer_fixture``), built once per run."""
    return make_test_tokenizer()
