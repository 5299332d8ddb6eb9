"""Rotary position embeddings as the batched forward turns q and k: Llama's halves, GLM's
neighbouring pairs, and a head's first part only (a partial rotation).

Why a module of its own: the attention layers of every family turn their heads through these
(the per-head q/k of ``gateway.engine.forward.batched``, the shared rotary key of latent
attention), and each is row-wise: a row's bits are its own.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from gateway.engine.native.build import NativeBuildError, load

SOURCE = Path(__file__).resolve().parent / "native" / "rotary.c"
"""The rotate-half kernel's C source: torch's numbers in one call (its header says why)."""

_int64 = ctypes.c_int64
_pointer = ctypes.c_void_p

Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``rotate(x, cos, sin)`` of ``x`` ``[rows, heads, d]`` by tables ``[rows, d]``."""


def partially(rotate: Rotation, x: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """``rotate`` of each head's first ``cos.shape[-1]`` numbers, the rest passed as they are
    (a partial rotation, as transformers' GLM and Phi-3 apply it); the whole head where the
    tables are as wide as it. The rotation computes in the tables' dtype and returns ``x``'s:
    OLMo 2's tables stay float32 beside bfloat16 heads, and transformers rotates it so."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return rotate(x, cos, sin).to(x.dtype)
    return torch.cat([rotate(x[..., :width], cos, sin).to(x.dtype), x[..., width:]], dim=-1)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[rows, heads, d]`` turning neighbouring pairs
    (2i, 2i + 1) by the i-th frequency (GLM's form: the tables' first half, each entry twice)."""
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[rows, heads, d]`` (Llama's rotate-half form): in
    one C call where it fits (float32 on the CPU; the same bits), else through torch."""
    kernel = halves_kernel()
    if kernel is not None and kernel.fits(x, cos, sin):
        return kernel(x, cos, sin)
    return torch_rotate_halves(x, cos, sin)


def torch_rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rotate_halves`` through torch's operations (any dtype and device)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class HalvesKernel:
    """``rotate_halves`` compiled (``native/rotary.c``): torch's numbers bit for bit."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.kvgate_rotate_halves_f32
        function.restype = None
        function.argtypes = [_pointer, _int64, _int64, _int64, _int64, _int64, _pointer,
                             _pointer, _int64, _pointer]
        self._function = function

    @classmethod
    def load(cls, *, portable: bool = False) -> HalvesKernel:
        """Raises ``NativeBuildError`` where it cannot be built."""
        return cls(load(SOURCE, portable=portable))

    @staticmethod
    def fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether it computes this rotation: float32 on the CPU, ``x`` ``[rows, heads, d]``
        with each head's numbers side by side, tables ``[rows, d]`` (rows side by side)."""
        if x.dim() != 3 or cos.dim() != 2 or x.device.type != "cpu":
            return False
        rows, _, dim = x.shape
        return (x.dtype == cos.dtype == sin.dtype == torch.float32 and dim % 2 == 0
                and tuple(cos.shape) == tuple(sin.shape) == (rows, dim)
                and x.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
                and cos.stride(0) == sin.stride(0) and sin.device.type == cos.device.type
                == "cpu")

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rows, heads, dim = x.shape
        out = torch.empty((rows, heads, dim), dtype=x.dtype)
        self._function(x.data_ptr(), rows, heads, dim, x.stride(0), x.stride(1),
                       cos.data_ptr(), sin.data_ptr(), cos.stride(0), out.data_ptr())
        return out


@functools.cache
def halves_kernel() -> HalvesKernel | None:
    """This machine's build, made on first use; None where no C compiler builds it (torch's
    operations then compute the same numbers)."""
    try:
        return HalvesKernel.load()
    except NativeBuildError:
        return None
