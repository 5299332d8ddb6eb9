"""Attention that reads each sequence's K/V in place through its block table (CPU, float32).

Why: with KV in a pool of pages (``tiers.page_pool``), torch's kernels need each sequence's
pages of a layer gathered into one contiguous tensor first -- a copy of the whole sequence per
layer and step (~20 ms of a 135 ms decode step of eight 1.5k-token SmolLM2 sequences). This
attention walks the table instead: one call per layer for every row of the step, in a small C
kernel (``native/paged_attention.c``) compiled on the machine at first use.

Its numbers: every row is computed by the same fixed sequence of IEEE operations, whatever else
is in the call (the C file says which), so a row depends only on its own query, position and
sequence -- never on the batch, the chunking, or whether it is a decode row (decode rows have a
prefill's numbers). The operations are spelled out and compiled without contraction or
fast-math, so the bits are the same on every machine (AVX2, AVX-512, none: only the speed
differs). The start-up probe re-checks invariance on the real weights anyway.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gateway.engine.attention.tiled import AttentionItem, shared_sinks
from gateway.engine.kv.sequence import LayerPages
from gateway.engine.native.build import NativeBuildError, load

NUMERICS = "p8fma"
"""This attention's part of the block namespace (see ``gateway.engine.attention.tiled.NUMERICS``):
eight-lane fused dot products, a fixed exp polynomial, keys summed in order. Any change to the
numbers the C kernel produces must change this name."""

SOURCE = Path(__file__).resolve().parent / "native" / "paged_attention.c"
"""The kernel's C source (built by ``gateway.engine.native.build``)."""

_int64 = ctypes.c_int64
_int = ctypes.c_int
_pointer = ctypes.c_void_p


class PagedKernel:
    """The compiled kernel's entry point, typed (``load`` builds it if needed)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        function = library.kvgate_paged_attention_f32
        function.restype = _int
        function.argtypes = [_pointer, _pointer, _int64, _int, _int, _int, _int, _pointer,
                             _int64, _pointer, _pointer, _pointer, _int64, ctypes.c_float,
                             _int64, ctypes.c_float, _pointer, _pointer]
        self._function = function

    @classmethod
    def load(cls, *, portable: bool = False, wide_vectors: bool = True) -> PagedKernel:
        """``wide_vectors``: AVX-512's paths where this CPU has them (False: its AVX2 paths,
        the same bits). Raises ``NativeBuildError`` where it cannot be built."""
        return cls(load(SOURCE, portable=portable, wide_vectors=wide_vectors))

    def __call__(self, key_pages: torch.Tensor, value_pages: torch.Tensor, tables: torch.Tensor,
                 queries: torch.Tensor, row_item: torch.Tensor, row_position: torch.Tensor,
                 out: torch.Tensor, window: int | None = None,
                 scale: float | None = None, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        """``softcap``: the layer's logit soft-cap, or None; ``sinks``: the layer's attention
        sinks ``[heads]`` (float32, contiguous), or None."""
        kv_heads, _, page_tokens, head_dim = key_pages.shape
        rep = queries.shape[1] // kv_heads
        if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()
                                  or tuple(sinks.shape) != (queries.shape[1],)):
            raise ValueError(f"sinks are float32 and contiguous, one per query head: got "
                             f"{tuple(sinks.shape)} {sinks.dtype}")
        failed = self._function(
            key_pages.data_ptr(), value_pages.data_ptr(), key_pages.stride(0), kv_heads, rep,
            page_tokens, head_dim, tables.data_ptr(), tables.stride(0), queries.data_ptr(),
            row_item.data_ptr(), row_position.data_ptr(), queries.shape[0],
            1.0 / math.sqrt(head_dim) if scale is None else scale, window or 0, softcap or 0.0,
            out.data_ptr(), None if sinks is None else sinks.data_ptr())
        if failed:
            raise MemoryError("the paged attention kernel could not allocate its scratch memory")


@functools.cache
def _kernel() -> PagedKernel:
    """The kernel, built and loaded on first use (once per process: a library stays loaded)."""
    return PagedKernel.load()


def paged_kernel_problem(device: torch.device, dtype: torch.dtype,
                         head_dim: int = 64) -> str | None:
    """Why ``PagedAttention`` cannot run here for heads of ``head_dim``, or None (building the
    kernel if needed)."""
    if head_dim % 8:
        return f"the paged C kernel takes head_dim in multiples of 8, not {head_dim}"
    if device.type != "cpu":
        return f"the paged C kernel runs on the CPU, not {device.type}"
    if dtype != torch.float32:
        return f"the paged C kernel computes in float32, not {str(dtype).removeprefix('torch.')}"
    try:
        _kernel()
    except NativeBuildError as exc:
        return str(exc)
    return None


class PagedAttention:
    """Each row's attention over its own sequence's pages, read in place, in one call per step.

    Items whose K/V are not pages (``ContiguousKV``: tests, oracles) are read as one page each.

    Args:
        kernel: the compiled kernel (default: this machine's build, made on first use).

    Raises (from ``attend``):
        ValueError: a row's position is past what its sequence holds, or head shapes disagree.
    """

    numerics = NUMERICS

    def __init__(self, kernel: PagedKernel | None = None) -> None:
        self._given = kernel
        self._last_rows: _StepRows | None = None

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        if not items:
            return []
        groups: dict[tuple[int, int, int], list[int]] = {}
        sources = [_pages_of(item) for item in items]
        for index, (key_pages, value_pages, _) in enumerate(sources):
            group = (key_pages.data_ptr(), value_pages.data_ptr(), int(key_pages.shape[2]))
            if group not in groups:  # a pool's layer checked once a call, not once an item
                _check_layout(key_pages, value_pages)
                groups[group] = []
            groups[group].append(index)
        out: list[torch.Tensor | None] = [None] * len(items)
        for indices in groups.values():
            for index, attended in zip(indices, self._call(self._given or _kernel(),
                                                           [items[i] for i in indices],
                                                           [sources[i] for i in indices]),
                                       strict=True):
                out[index] = attended
        return [attended for attended in out if attended is not None]

    def _call(self, kernel: PagedKernel, items: Sequence[AttentionItem],
              sources: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
              ) -> list[torch.Tensor]:
        key_pages, value_pages, _ = sources[0]
        kv_heads, _, page_tokens, head_dim = key_pages.shape
        heads = items[0].queries.shape[1]
        if heads % kv_heads or items[0].queries.shape[2] != head_dim or head_dim % 8:
            raise ValueError(f"queries {tuple(items[0].queries.shape)} do not fit K/V pages "
                             f"{tuple(key_pages.shape)} (head_dim a multiple of 8)")
        windows = {item.window for item in items}
        scales = {item.scale for item in items}
        if len(windows) > 1 or len(scales) > 1:
            raise ValueError("the items of one layer's attention share its window and scale")
        softcaps = {item.softcap for item in items}
        if len(softcaps) > 1:
            raise ValueError("the items of one layer's attention share its soft-cap")
        rows = self._rows(items, sources, page_tokens)
        queries = torch.cat([item.queries for item in items]).to(torch.float32).contiguous()
        out = torch.empty_like(queries)
        sinks = shared_sinks(items)
        kernel(key_pages, value_pages, rows.tables, queries, rows.row_item, rows.positions, out,
               windows.pop(), scales.pop(), softcaps.pop(),
               None if sinks is None else sinks.to(torch.float32).contiguous())
        return list(torch.split(out, rows.counts))

    def _rows(self, items: Sequence[AttentionItem],
              sources: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
              page_tokens: int) -> _StepRows:
        """The tables and rows of ``items``, checked: made for a step's first layer and reused
        while the next layers pass the same spans over the same table tensors (the forward's
        items say their ``first_position``; tests' and oracles' are made each time).

        Raises:
            ValueError: a row's position is outside what its sequence holds.
        """
        tables_in = tuple(table for _, _, table in sources)
        counts = [int(item.queries.shape[0]) for item in items]
        firsts = [item.first_position for item in items]
        spans = (None if None in firsts
                 else tuple(zip((int(f or 0) for f in firsts), counts, strict=True)))
        last = self._last_rows
        if (spans is not None and last is not None and last.spans == spans
                and len(last.tables_in) == len(tables_in)
                and all(a is b for a, b in zip(last.tables_in, tables_in, strict=True))):
            return last
        width = max(int(table.numel()) for table in tables_in)
        tables = torch.zeros(len(items), width, dtype=torch.int64)
        for row, table in enumerate(tables_in):
            tables[row, :table.numel()] = table
        positions = torch.cat([item.positions for item in items]).to(torch.int64).contiguous()
        row_item = torch.repeat_interleave(torch.arange(len(items)), torch.tensor(counts))
        held = torch.tensor([int(table.numel()) * page_tokens for table in tables_in])
        if bool((positions >= held[row_item]).any()) or bool((positions < 0).any()):
            raise ValueError("a query's position is past the K/V its sequence holds")
        rows = _StepRows(tables_in=tables_in, spans=spans, counts=counts, tables=tables,
                         positions=positions, row_item=row_item)
        if spans is not None:
            self._last_rows = rows  # one assignment: another thread sees the old or the new
        return rows


@dataclass(frozen=True, slots=True, kw_only=True)
class _StepRows:
    """What every layer of a step passes the kernel besides its queries and pages: the joined
    block tables, each row's position and sequence, checked against what the tables hold.

    ``tables_in`` holds the sequences' own table tensors, so no other tensor takes their
    identities while this record may be reused for them."""

    tables_in: tuple[torch.Tensor, ...]
    spans: tuple[tuple[int, int], ...] | None
    counts: list[int]
    tables: torch.Tensor
    positions: torch.Tensor
    row_item: torch.Tensor


def _pages_of(item: AttentionItem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``item``'s K/V as (key pages, value pages, table): its pool's in place where it has
    pages, else its contiguous tensors as one page (the layout is checked by the caller, once
    for each pool's layer)."""
    kv = item.kv
    if isinstance(kv, LayerPages):
        table = kv.table if kv.table.dtype == torch.int64 else kv.table.to(torch.int64)
        return kv.key_pages, kv.value_pages, table
    keys, values = kv.keys().contiguous(), kv.values().contiguous()
    one = torch.zeros(1, dtype=torch.int64)
    return keys.unsqueeze(1), values.unsqueeze(1), one


def _check_layout(key_pages: torch.Tensor, value_pages: torch.Tensor) -> None:
    """The kernel reads pages ``[kv_heads, pages, page_tokens, head_dim]`` with unit strides
    inside a head and the same strides for K and V."""
    if (key_pages.dtype != torch.float32 or value_pages.stride() != key_pages.stride()
            or key_pages.stride()[1:] != (key_pages.shape[2] * key_pages.shape[3],
                                          key_pages.shape[3], 1)):
        raise ValueError(f"K/V pages of dtype {key_pages.dtype}, strides {key_pages.stride()} "
                         "are not the float32 page layout the paged kernel reads")
