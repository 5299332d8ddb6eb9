"""Products whose rows keep their bits at any row count: kvgate's C kernel over weights kept in
panels of 16 columns (``native/panel_products.c`` says the arithmetic).

Why: oneDNN's and MKL's products keep a row's bits only from 2 or 4 rows up, because they pick
another kernel for fewer, and their packed layouts are read at about 60% of the memory's pace
when a step has few rows -- decoding, where a step is one read of the weights. This kernel sums
each output number in one fixed order (a fused multiply-add per input, in order) whatever the
row count, so one row is multiplied as one row, and the numbers are the same on every CPU
(AVX-512, AVX2 or neither: only the speed differs), so blocks computed on one replica are the
blocks another computes. Measured on this project's 2-core AMD EPYC (AVX-512, float32,
SmolLM2-135M's 211 products including the logits head, out of cache): 1 row 17.5 ms against
oneDNN's 29 ms (2 rows, packed), 8 rows 22-23 against 25-28 ms, and within 6% of oneDNN from 64
to 1,024 rows (180-200 GFLOPS): the weights are read at the memory's pace.

A weight is multiplied in its panel layout (``Panels``, made once at start-up in place of the
plain weight: ``gateway.engine.linear.packed_weights``); a plain weight handed to ``product``
(the start-up search, tests) is laid out for the call. A weight whose numbers are a GGUF's
4- or 8-bit blocks dequantised, or all bfloat16s (a bfloat16 checkpoint served in float32), is
kept as those codes or 16 bits (``gateway.engine.linear.coded_panels``): the same numbers
multiplied, fewer bytes read.
"""

from __future__ import annotations

import ctypes
import functools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from gateway.engine.linear import row_norms
from gateway.engine.linear.coded_panels import BLOCK, CodedBlocks, Coding
from gateway.engine.native.build import NativeBuildError, load

PANEL = 16
"""Columns of a panel (the C kernel's ``PANEL``)."""

SOURCE = Path(__file__).resolve().parent / "native" / "panel_products.c"
"""The kernel's C source (built by ``gateway.engine.native.build``)."""

NUMERICS = "pnl16"
"""The kernel's part of the block namespace: one fused multiply-add per input, in order. Any
change to the numbers the C kernel produces must change this name."""

_int64 = ctypes.c_int64
_pointer = ctypes.c_void_p


class PanelKernel:
    """The compiled kernel's entry point, typed."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.kvgate_panel_product_f32
        function.restype = None
        function.argtypes = [_pointer, _int64, _int64, _int64, _pointer, _int64, _pointer,
                             _pointer, _int64]
        self._function = function
        coded = library.kvgate_coded_panel_product_f32
        coded.restype = None
        coded.argtypes = [_pointer, _int64, _int64, _int64, _pointer, ctypes.c_int, _int64,
                          _pointer, _pointer, _int64]
        self._coded = coded

    @classmethod
    def load(cls, *, portable: bool = False, wide_vectors: bool = True) -> PanelKernel:
        """``wide_vectors``: AVX-512's paths where this CPU has them (False: its AVX2 paths,
        what an AVX2-only CPU runs). Raises ``NativeBuildError`` where it cannot be built."""
        return cls(load(SOURCE, portable=portable, wide_vectors=wide_vectors))

    def __call__(self, rows: torch.Tensor, panels: Panels,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
        """``rows`` ``[m, k]`` times the weight in ``panels``, plus ``bias`` ``[n]``:
        ``[m, n]``, float32."""
        out_features, in_features = panels.shape
        rows = rows.contiguous()
        if rows.dtype != torch.float32 or panels.dtype != torch.float32:
            raise ValueError(f"the panel kernel multiplies float32, not {rows.dtype} rows by "
                             f"{panels.dtype} panels")
        if rows.dim() != 2 or rows.shape[1] != in_features:
            raise ValueError(f"rows {tuple(rows.shape)} do not fit a weight of "
                             f"{in_features} inputs")
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
        bias_pointer = None if bias is None else bias.data_ptr()
        if not rows.shape[0]:
            return out
        if panels.coding is None:
            self._function(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.shape[1],
                           panels.data.data_ptr(), out_features, bias_pointer, out.data_ptr(),
                           out_features)
        else:
            self._coded(rows.data_ptr(), rows.shape[0], rows.shape[1], rows.shape[1],
                        panels.data.data_ptr(), panels.coding.bits, out_features, bias_pointer,
                        out.data_ptr(), out_features)
        return out


@functools.cache
def kernel() -> PanelKernel:
    """This machine's build, made on first use (once per process: a library stays loaded)."""
    return PanelKernel.load()


def panel_kernel_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the panel kernel cannot multiply ``dtype`` rows on ``device`` here, or None
    (building it if needed)."""
    if device.type != "cpu":
        return f"the panel kernel runs on the CPU, not {device.type}"
    if dtype != torch.float32:
        return f"the panel kernel computes in float32, not {str(dtype).removeprefix('torch.')}"
    try:
        kernel()
        row_norms.kernel()  # the route's norms: products and norms are there together or not
    except NativeBuildError as exc:
        return str(exc)
    return None


@dataclass(frozen=True, slots=True)
class Panels:
    """A weight ``[n, k]`` laid out in panels (module docstring): ``data`` ``[ceil(n / 16), k,
    16]``, zero past ``n``; or, with a ``coding``, the coded blocks of ``CodedBlocks.data``.
    It stands where a projection's weight stood, so it says the plain weight's ``shape``,
    ``dtype`` and ``device``."""

    data: torch.Tensor
    out_features: int
    coding: Coding | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, *, coded: bool = True) -> Panels:
        """``weight`` ``[n, k]`` laid out in panels (a new tensor); kept as codes where
        ``coded`` and its numbers are (``coded_panels``)."""
        if coded and (blocks := CodedBlocks.of(weight)) is not None:
            return cls(data=blocks.data, out_features=int(weight.shape[0]),
                       coding=blocks.coding)
        out_features, in_features = weight.shape
        num_panels = -(-out_features // PANEL)
        padded = weight.detach()
        if out_features % PANEL:  # zero columns up to the last panel's width
            padded = padded.new_zeros(num_panels * PANEL, in_features)
            padded[:out_features] = weight.detach()
        data = padded.reshape(num_panels, PANEL, in_features).transpose(1, 2).contiguous()
        return cls(data=data, out_features=int(out_features))

    @property
    def shape(self) -> torch.Size:
        inputs = int(self.data.shape[1]) * (1 if self.coding is None else BLOCK)
        return torch.Size((self.out_features, inputs))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype if self.coding is None else torch.float32

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def plain(self) -> torch.Tensor:
        """The plain weight ``[n, k]`` (a copy: the numbers moved, or expanded from codes)."""
        whole = self._whole()
        num_panels, in_features, _ = whole.shape
        plain = whole.transpose(1, 2).reshape(num_panels * PANEL, in_features)
        return plain[:self.out_features].contiguous()

    def row(self, ids: torch.Tensor) -> torch.Tensor:
        """The plain weight's rows ``ids`` ``[len(ids), k]`` (an embedding table's lookup)."""
        if self.coding is None:
            return self.data[ids // PANEL, :, ids % PANEL]
        rows = CodedBlocks(data=self.data, coding=self.coding).rows(ids.reshape(-1))
        return rows.reshape(*ids.shape, rows.shape[-1])

    def _whole(self) -> torch.Tensor:
        """Every panel as float32 ``[n / 16, k, 16]``."""
        if self.coding is None:
            return self.data
        return CodedBlocks(data=self.data, coding=self.coding).panels()


CODING_NAMES = {None: "whole float32", 4: "4-bit codes", 8: "8-bit codes", 16: "bfloat16s"}


def coding_summary(weights: Iterable[Panels]) -> str:
    """How ``weights`` are kept, for the start-up log: how many in each coding and the bytes a
    step reads against whole float32 panels (one weight shared by two modules counted once)."""
    distinct = list({id(w): w for w in weights}.values())
    counts = Counter(CODING_NAMES[None if w.coding is None else w.coding.bits]
                     for w in distinct)
    held = sum(w.nbytes for w in distinct)
    whole = sum(w.shape[0] * w.shape[1] * 4 for w in distinct)
    kinds = ", ".join(f"{count} as {name}" for name, count in counts.most_common())
    return f"{kinds}: {held / 2**20:,.0f} MiB read a step against {whole / 2**20:,.0f} MiB whole"


def panel_product(rows: torch.Tensor, weight: torch.Tensor | Panels,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """``rows @ weight.T (+ bias)`` by this machine's panel kernel; a plain ``weight`` is laid
    out for the call (the start-up search and tests; the forward's weights are laid out once),
    and so is one packed for oneDNN (an engine of another route over the same model)."""
    if isinstance(weight, torch.Tensor) and weight.is_mkldnn:
        weight = weight.to_dense()
    panels = weight if isinstance(weight, Panels) else Panels.of(weight)
    return kernel()(rows, panels, bias)
