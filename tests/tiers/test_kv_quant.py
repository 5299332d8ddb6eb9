"""K/V quantization for lossy tiers: what it computes, what it loses, what it saves.

int8 is checked value for value against a plain numpy reference (the specification: one
float32 scale ``amax / 127`` per row of ``head_dim``, round half to even); both formats are held
to the error bounds ``tiers.kv_quant`` states, and to the size docs/design.md promises.
"""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import numpy.typing as npt
import pytest
import torch
from hypothesis import given, settings

from tiers.base import CodecError
from tiers.kv_quant import dequantize, quantize, quantized_bytes_per_token, supported
from tiers.payload import KVLayout

PROPERTY = settings(max_examples=200, deadline=None)
needs_fp8 = pytest.mark.skipif(not supported("fp8", "cpu"), reason="no fp8 casts on this CPU")


def reference_int8(x: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int8],
                                                        npt.NDArray[np.float32]]:
    """The specification, in numpy: per row, ``s = amax / 127``, ``q = rint(x / s)``."""
    amax = np.abs(x).max(axis=-1)
    scales = (amax / np.float32(127)).astype(np.float32)
    divisor = np.where(scales > 0, scales, np.float32(1))[..., None]
    q = np.clip(np.rint(x / divisor), -127, 127).astype(np.int8)
    return q, scales


def kv_rows(*, max_magnitude: float = 1e6) -> st.SearchStrategy[npt.NDArray[np.float32]]:
    """[heads, tokens, head_dim] float32 K/V, finite, magnitudes from tiny to large, with
    zeros and exact duplicates (hypothesis finds the rows with ties and sign flips)."""
    elements = st.floats(-max_magnitude, max_magnitude, width=32, allow_nan=False,
                         allow_infinity=False, allow_subnormal=False)
    shapes = hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=6)
    return hnp.arrays(np.float32, shapes, elements=elements)


@PROPERTY
@given(kv_rows())
def test_int8_is_the_reference_value_for_value(x: npt.NDArray[np.float32]) -> None:
    q, scales = quantize(torch.from_numpy(x), "int8")
    want_q, want_scales = reference_int8(x)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    np.testing.assert_array_equal(q.numpy(), want_q)
    np.testing.assert_array_equal(scales.numpy(), want_scales)


@PROPERTY
@given(kv_rows(), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_dequantizing_is_the_reference_product_rounded_once(
        x: npt.NDArray[np.float32], dtype: torch.dtype) -> None:
    """``q * s`` in float32 (an exact conversion, one rounded product), then rounded once to
    the K/V dtype: the value every tier, device and machine must agree on."""
    q, scales = quantize(torch.from_numpy(x), "int8")
    want = (q.numpy().astype(np.float32) * scales.numpy()[..., None]).astype(np.float32)
    got = dequantize(q, scales, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, torch.from_numpy(want).to(dtype))
    out = torch.empty(q.shape, dtype=dtype)
    assert dequantize(q, scales, dtype, out=out) is out and torch.equal(out, got)
    # A page of the pool: one page of [..., pages, tokens, head_dim], strided.
    pages = torch.empty((*q.shape[:-2], 3, *q.shape[-2:]), dtype=dtype)
    page = pages[..., 1, :, :]
    assert dequantize(q, scales, dtype, out=page) is page and torch.equal(page, got)


@PROPERTY
@given(kv_rows())
def test_int8_error_is_at_most_half_a_step_of_the_rows_scale(
        x: npt.NDArray[np.float32]) -> None:
    q, scales = quantize(torch.from_numpy(x), "int8")
    error = (dequantize(q, scales, torch.float32) - torch.from_numpy(x)).abs()
    amax = torch.from_numpy(np.abs(x).max(axis=-1)).unsqueeze(-1)
    assert bool((error <= amax / 254 * (1 + 2**-16)).all())


@needs_fp8
@PROPERTY
@given(kv_rows(max_magnitude=1e4))
def test_fp8_error_is_within_its_relative_bound(x: npt.NDArray[np.float32]) -> None:
    q, scales = quantize(torch.from_numpy(x), "fp8")
    assert q.dtype == torch.float8_e4m3fn
    want = torch.from_numpy(x)
    error = (dequantize(q, scales, torch.float32) - want).abs()
    bound = (want.abs() * 2**-4 + scales.unsqueeze(-1) * 2**-10) * (1 + 2**-16)
    assert bool((error <= bound).all())


@PROPERTY
@given(kv_rows())
def test_requantizing_a_dequantized_block_gives_it_back(x: npt.NDArray[np.float32]) -> None:
    """A lossy block moved from one int8 tier to another does not drift further."""
    q, scales = quantize(torch.from_numpy(x), "int8")
    again, _ = quantize(dequantize(q, scales, torch.float32), "int8")
    assert torch.equal(again, q)


def test_zero_rows_stay_exactly_zero() -> None:
    x = torch.zeros(2, 3, 8)
    x[0, 1] = torch.arange(8.0)
    for quantization in ("int8", "fp8") if supported("fp8", "cpu") else ("int8",):
        q, scales = quantize(x, quantization)
        back = dequantize(q, scales, torch.float32)
        assert torch.equal(back[1], torch.zeros(3, 8))
        assert torch.equal(scales[1], torch.zeros(3))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_k_v_that_is_not_finite_is_refused_not_garbled(bad: float) -> None:
    x = torch.ones(1, 2, 4)
    x[0, 1, 2] = bad
    with pytest.raises(CodecError) as raised:
        quantize(x, "int8")
    assert raised.value.reason == "shape"


def test_bfloat16_k_v_round_trips_within_the_bound_plus_its_own_rounding() -> None:
    x = torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, scales = quantize(x, "int8")
    back = dequantize(q, scales, torch.bfloat16)
    assert back.dtype == torch.bfloat16
    exact = x.float()
    amax = exact.abs().amax(-1, keepdim=True)
    error = (back.float() - exact).abs()
    assert bool((error <= amax / 254 * (1 + 2**-16) + exact.abs() * 2**-8).all())


@pytest.mark.parametrize(("head_dim", "ratio"), [(64, 0.265625), (128, 0.2578125)])
def test_int8_takes_at_most_0_27x_the_bytes_of_float32(head_dim: int, ratio: float) -> None:
    layout = KVLayout(num_layers=30, kv_heads=3, head_dim=head_dim, dtype=torch.float32)
    lossy = quantized_bytes_per_token(layout.num_layers, layout.kv_heads, layout.head_dim)
    assert lossy / layout.bytes_per_token == ratio
    assert ratio <= 0.27


def test_fp8_support_is_probed_per_device_type() -> None:
    assert supported("int8", "cpu")
    assert not supported("fp8", "no-such-device")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_into_a_gpu_page_gives_the_hosts_bits(dtype: torch.dtype) -> None:
    """A block loaded for a GPU goes up quantized and is scaled there: the same bits as the
    host's dequantization (an exact conversion and one rounded product on either)."""
    x = torch.randn(4, 2, 2, 64, 16, generator=torch.Generator().manual_seed(3)) * 10
    q, scales = quantize(x, "int8")
    on_host = dequantize(q, scales, dtype)
    pages = torch.zeros(4, 2, 2, 3, 64, 16, dtype=dtype, device="cuda")
    page = pages[:, :, :, 1]  # a pool's page: strided
    assert dequantize(q, scales, dtype, out=page) is page
    assert torch.equal(page.cpu(), on_host)
