"""The recurrent layers' per-sequence part runs on one intra-op thread
(``gateway.engine.forward.recurrent.one_thread``), and the setting is given back after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from gateway.engine.forward.recurrent.one_thread import one_thread, subnormals_flushed


@pytest.fixture()
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_inside_one_thread_torch_uses_one_and_after_it_as_many_as_before() -> None:
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_the_thread_count_is_given_back_when_the_inside_raises() -> None:
    with pytest.raises(RuntimeError, match="inside"), one_thread():
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("two_threads")
def test_subnormals_are_flushed_only_where_one_thread_computes() -> None:
    with pytest.raises(RuntimeError, match="one thread only"), subnormals_flushed():
        pass
    with one_thread(), subnormals_flushed():
        assert torch.get_num_threads() == 1
