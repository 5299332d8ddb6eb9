"""Llama's rotate-half rotation in one C call: torch's numbers bit for bit, or torch itself."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.forward.rotary import (
    HalvesKernel,
    halves_kernel,
    partially,
    rotate_halves,
    torch_rotate_halves,
)

KERNEL = halves_kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler builds the rotary kernel")


def _tables(rows: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(rows, dim, generator=torch.Generator().manual_seed(seed)) * 1e3
    return angles.cos(), angles.sin()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 12), heads=st.integers(1, 9), half=st.integers(1, 40),
       columns_after=st.integers(0, 24), seed=st.integers(0, 2**16))
def test_the_kernel_computes_torchs_bits(rows, heads, half, columns_after, seed) -> None:
    """Heads read in place from a wider projection output (as q and k are split from q|k|v)."""
    dim = 2 * half
    wide = torch.randn(rows, heads * dim + columns_after,
                       generator=torch.Generator().manual_seed(seed)) * 5
    x = wide[:, :heads * dim].reshape(rows, heads, dim)
    cos, sin = _tables(rows, dim, seed + 1)
    assert KERNEL is not None and KERNEL.fits(x, cos, sin)
    assert torch.equal(rotate_halves(x, cos, sin), torch_rotate_halves(x, cos, sin))


def test_tables_sliced_from_a_wider_table_are_read_in_place() -> None:
    """A layer's own kind of rotation reads its columns of the step's joined tables."""
    x = torch.randn(4, 3, 16)
    cos, sin = _tables(4, 40, 3)
    cos, sin = cos[:, 8:24], sin[:, 8:24]
    assert torch.equal(rotate_halves(x, cos, sin), torch_rotate_halves(x, cos, sin))


def test_a_partial_rotation_rotates_through_the_kernel_with_torchs_bits() -> None:
    x = torch.randn(5, 2, 64)
    cos, sin = _tables(5, 32, 4)
    assert torch.equal(partially(rotate_halves, x, cos, sin),
                       partially(torch_rotate_halves, x, cos, sin))


def test_the_portable_build_computes_the_same_bits() -> None:
    x = torch.randn(7, 5, 40)
    cos, sin = _tables(7, 40, 5)
    portable = HalvesKernel.load(portable=True)
    assert torch.equal(portable(x, cos, sin), torch_rotate_halves(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_rotate_through_torch(dtype) -> None:
    x = torch.randn(3, 2, 8).to(dtype)
    cos, sin = (t.to(dtype) for t in _tables(3, 8, 6))
    assert KERNEL is not None and not KERNEL.fits(x, cos, sin)
    assert torch.equal(rotate_halves(x, cos, sin), torch_rotate_halves(x, cos, sin))
