"""RMSNorm in one call on the calling thread: kvgate's C kernel (``native/row_norms.c`` says the
arithmetic), the norms of the panels route.

Why: a norm through torch is eight small operations -- a few vectors of 576 or 64 floats a
decode row -- each a dispatch and some a parallel region that wakes the other core. A Qwen3
layer has four norms (before attention, before the MLP, and each head's q and k), so a decode
step of SmolLM2's shape made ~1,000 such calls; measured on this project's 2-core Intel Xeon,
they were about a tenth of an eight-row step. The kernel computes each row alone in a fixed
order, so a row's bits depend on that row only (any batch, any chunking) and are the same on
every CPU.

The route that lays weights out in panels swaps each plain RMSNorm module of the model (a class
saying ``rms_in_float32``: ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32) for a
``RowRMSNorm`` over the same weight, and swaps it back when the weights go back plain, as
``packed_weights`` does with projections. Its numbers are not torch's (the sum's order, the
reciprocal square root), so they are part of the panels route's namespace.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gateway.engine.native.build import load

SOURCE = Path(__file__).resolve().parent / "native" / "row_norms.c"
"""The kernel's C source (built by ``gateway.engine.native.build``)."""

NUMERICS = "rms8"
"""The norms' part of the block namespace: squares summed in eight lanes and a fixed tree, one
division and one square root. Any change to the numbers the C kernel produces must change this
name."""

_int64 = ctypes.c_int64
_pointer = ctypes.c_void_p


class RowNormKernel:
    """The compiled kernel's entry point, typed (``load`` builds it if needed)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.kvgate_rms_norm_f32
        function.restype = None
        function.argtypes = [_pointer, _int64, _int64, _int64, _pointer, ctypes.c_float,
                             _pointer, _int64]
        self._function = function

    @classmethod
    def load(cls, *, portable: bool = False) -> RowNormKernel:
        """Raises ``NativeBuildError`` where it cannot be built."""
        return cls(load(SOURCE, portable=portable))

    def __call__(self, rows: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Each row of ``rows`` (float32 on the CPU, normalised over its last dimension, which
        is ``weight``'s length) normalised: a new tensor of ``rows``' shape."""
        width = int(weight.shape[0])
        if (rows.dtype != torch.float32 or weight.dtype != torch.float32
                or rows.device.type != "cpu" or rows.shape[-1] != width):
            raise ValueError(f"the row norm takes float32 rows of {width} on the CPU, got "
                             f"{tuple(rows.shape)} {rows.dtype} on {rows.device}")
        rows = rows.contiguous()
        weight = weight.contiguous()
        out = torch.empty_like(rows)
        self._function(rows.data_ptr(), rows.numel() // width if width else 0, width, width,
                       weight.data_ptr(), eps, out.data_ptr(), width)
        return out


@functools.cache
def kernel() -> RowNormKernel:
    """This machine's build, made on first use (once per process: a library stays loaded)."""
    return RowNormKernel.load()


class RowRMSNorm(nn.Module):
    """An RMSNorm computed by the row kernel; ``original`` is the module it replaced, kept so
    that swapping back restores the very module (its class, hooks and attributes)."""

    def __init__(self, original: nn.Module, row_kernel: RowNormKernel | None = None) -> None:
        super().__init__()
        self.original = [original]  # a list: not registered as a submodule (no second walk)
        weight = original.weight
        assert isinstance(weight, torch.Tensor)
        self.weight = weight
        eps = original.variance_epsilon
        assert isinstance(eps, float | int)
        self.variance_epsilon = float(eps)
        self._kernel = row_kernel or kernel()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._kernel(hidden_states, self.weight, self.variance_epsilon)


def _plain_norms(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, module) of each module whose class computes the plain float32 RMSNorm."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if getattr(type(child), "rms_in_float32", False) and _is_float32(child):
                found.append((parent, name, child))
    return found


def _is_float32(norm: nn.Module) -> bool:
    weight = getattr(norm, "weight", None)
    return (isinstance(weight, torch.Tensor) and weight.dtype == torch.float32
            and weight.dim() == 1 and weight.device.type == "cpu")


def swap_in_row_norms(model: Any) -> int:
    """Replace every plain float32 RMSNorm module of ``model`` by a ``RowRMSNorm`` over its
    weight (raises ``NativeBuildError`` where the kernel cannot be built); returns how many."""
    found = _plain_norms(model)
    if found:
        row_kernel = kernel()
        for parent, name, module in found:
            setattr(parent, name, RowRMSNorm(module, row_kernel))
    return len(found)


def swap_out_row_norms(model: Any) -> int:
    """Put every ``RowRMSNorm`` of ``model`` back as the module it replaced; returns how many."""
    found = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, RowRMSNorm)]
    for parent, name, child in found:
        setattr(parent, name, child.original[0])
    return len(found)
