"""Element-wise functions computed by row (``gateway.engine.forward.recurrent.lanes``): a row's
numbers have the same bits whatever rows come with it, at any width."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.forward.recurrent.lanes import by_row

FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "exp": torch.exp, "sigmoid": torch.sigmoid, "silu": F.silu, "softplus": F.softplus}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(FUNCTIONS)), st.integers(1, 40), st.integers(1, 70),
       st.integers(0, 2**16))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(name: str, num_rows: int, width: int,
                                                          seed: int) -> None:
    fn = FUNCTIONS[name]
    x = torch.randn(num_rows, width, generator=torch.Generator().manual_seed(seed)) * 4
    together = by_row(fn, x)
    for i in range(num_rows):
        assert torch.equal(together[i], by_row(fn, x[i:i + 1])[0])


def test_it_is_the_function_and_keeps_the_shape() -> None:
    x = torch.randn(3, 5, 7)
    assert by_row(torch.sigmoid, x).shape == (3, 5, 7)
    assert torch.allclose(by_row(torch.sigmoid, x), torch.sigmoid(x), atol=1e-7, rtol=0)
