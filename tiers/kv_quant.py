"""Quantizing K/V for a lossy tier: one scale per (layer, K or V, KV head, token).

Why per token and head: K and V rows of one token and head share a magnitude, while tokens and
heads differ by orders of magnitude (attention sinks, outlier channels of a head). One scale
per row of ``head_dim`` values keeps each row's error relative to that row's own largest value;
a scale per block or per layer would let one outlier token flatten every other token to zero.
The scales are float32, so the scale itself adds no error beyond float32 rounding.

What is lost, per value ``x`` of a row whose largest magnitude is ``amax`` (both formats are
symmetric, zero is exact, a row of zeros stays zeros):

- ``int8``: ``s = amax / 127``, ``q = round(x / s)`` (half to even) in [-127, 127];
  ``|x - q * s| <= s / 2 * (1 + 2**-16)`` -- at most ``amax / 254``, i.e. 0.394% of the row's
  largest value (the ``2**-16`` covers float32 rounding of the division and the product).
- ``fp8`` (float8 e4m3fn, 3 mantissa bits): ``s = amax / 448``; a value keeps about 2 significant
  digits: ``|x - dq| <= |x| * 2**-4 + s * 2**-10`` (relative 6.25% at worst for normal values,
  an absolute ``amax / 458752`` floor below ``2**-6 * s``). Coarser than int8 for a row's large
  values, finer for its small ones.

Then the dequantized value is rounded to the model's K/V dtype (bfloat16 adds its own
``2**-9`` relative). Re-quantizing a dequantized float32 row gives back the same ``q``: a lossy
block that moves between lossy tiers does not drift further.

Size, per token: ``2 * num_layers * kv_heads * (head_dim + 4)`` bytes (a byte per value, four
per scale), against ``2 * num_layers * kv_heads * head_dim * itemsize`` exact: for float32 K/V
``(head_dim + 4) / (4 * head_dim)``, 0.266x at ``head_dim = 64`` (SmolLM2), 0.258x at 128.
"""

from __future__ import annotations

import functools

import torch

from gateway.core.quantization import Quantization
from tiers.base import CodecError

SCALE_DTYPE = torch.float32
SCALE_BYTES = 4

_QMAX: dict[Quantization, float] = {"int8": 127.0, "fp8": 448.0}
"""The largest magnitude each format holds: a row's ``amax`` maps to it."""


def element_dtype(quantization: Quantization) -> torch.dtype:
    """The dtype of the quantized values.

    Raises:
        ValueError: fp8 on a torch build without float8 dtypes.
    """
    if quantization == "int8":
        return torch.int8
    dtype = getattr(torch, "float8_e4m3fn", None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch {torch.__version__} has no float8_e4m3fn dtype: use int8")
    return dtype


@functools.cache
def supported(quantization: Quantization, device_type: str) -> bool:
    """Whether torch can quantize and dequantize ``quantization`` on a device of this type
    (``"cpu"``, ``"cuda"``): int8 everywhere, fp8 where a cast there works (tried once)."""
    try:
        dtype = element_dtype(quantization)
        probe = torch.tensor([2.0, -1.0], device=device_type).to(dtype).to(torch.float32)
        return bool(torch.equal(probe.cpu(), torch.tensor([2.0, -1.0])))
    except (ValueError, RuntimeError, TypeError):
        return False


def quantize(rows: torch.Tensor, quantization: Quantization) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dimension of ``rows`` (any float dtype, any device).

    Returns:
        ``(q, scales)``: ``q`` of ``rows``' shape in ``element_dtype(quantization)``,
        ``scales`` of ``rows.shape[:-1]`` in float32, both on ``rows``' device.

    Raises:
        CodecError: reason "shape" when a value is not finite (NaN or infinity has no scale:
            such K/V is stored exactly or not at all, never as a garbled copy).
    """
    x = rows.to(torch.float32)
    peaks = x.abs().amax(dim=-1)
    # NOTE: divided by a tensor, not a Python number: CUDA turns division by a host scalar into
    # a product with its rounded reciprocal, whose bits differ from the CPU's true quotient --
    # a block quantized on a GPU must decode to exactly what the host's codec gives.
    scales = peaks / torch.full_like(peaks, _QMAX[quantization])
    if not bool(torch.isfinite(scales).all()):
        raise CodecError("shape", "K/V holds NaN or infinity: it cannot be quantized")
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    scaled = x / divisor
    if quantization == "int8":
        q = torch.round(scaled).clamp_(-127.0, 127.0).to(torch.int8)
    else:
        q = scaled.clamp_(-448.0, 448.0).to(element_dtype(quantization))
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
               *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scales`` (scales broadcast over the last dimension) in ``dtype``, into ``out``
    when given (it must have ``q``'s shape and ``dtype``; any strides and any device, e.g. a
    pool's page on a GPU, where it is computed)."""
    # NOTE: one buffer, converted into then scaled in place, not ``q.to(float32) * scales``:
    # the same values bit for bit (an exact conversion, one rounded product) from one fresh
    # allocation instead of two -- a fresh block-sized buffer costs its page faults, which are
    # most of a dequantization's time on a 2-core AMD EPYC.
    if out is not None and out.device != q.device:
        # A page on the GPU: the quantized values go up as they are (a quarter of float32's
        # bytes, half of bfloat16's) and are scaled there -- the same exact conversion and one
        # rounded product, so the same bits as on the host -- instead of on one host core.
        q, scales = q.to(out.device), scales.to(out.device)
    multiplier = scales.to(torch.float32).unsqueeze(-1)
    if out is not None and out.dtype == torch.float32 and out.device == q.device:
        # A float32 ``out`` (a page of the pool) is written in place: the same two steps, and
        # neither a fresh buffer nor a copy of it.
        return out.copy_(q).mul_(multiplier)
    values = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    values.copy_(q).mul_(multiplier)
    if out is None:
        return values if dtype == torch.float32 else values.to(dtype)
    out.copy_(values)
    return out


def quantized_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int) -> int:
    """Bytes one token's K and V take in a quantized block (values and scales)."""
    return 2 * num_layers * kv_heads * (head_dim + SCALE_BYTES)
