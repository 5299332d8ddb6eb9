"""Paged attention on CUDA: every sequence of a step in one Triton launch per layer.

Why: on a GPU the tiled attention (``gateway.engine.attention``) costs dozens of small kernel
launches per sequence and layer, and the gather of each sequence's pages (``KVSequence
.key_buffer``) one copy more; the forward is bound by launches, not arithmetic (docs/gpu.md).
Here one launch attends every query row of the step, reading K/V in place from the page pool
(``tiers.page_pool.PagePool.storage``) through each sequence's block table.

It keeps the invariance contract of ``gateway.engine.attention.SequenceAttention`` by fixed
shapes alone -- one program per query row (never a tile shared with other rows), splits of
``SPLIT_KEYS`` key positions fixed by absolute position, tiles of ``TILE_ROWS`` x
``TILE_KEYS`` in every launch, an exact max, splits folded in the order of their index, keys
after the row weighing exactly 0 (``gateway.engine.triton_paged_kernel`` says how) -- so a
row's bits never depend on the other rows of the launch, on how many queries its sequence has,
or on how its prompt was chunked. The start-up probe re-checks it on the device.

Two entry points: ``attend_paged`` is the kernel's own (one layer's K/V pages of the pool, an
int32 block table, per-row positions and sequence index); ``attend`` adapts the forward's
``AttentionItem``s to it: their ``LayerPages`` are read in place, while contiguous buffers
(tests, oracles) are first packed into a transient pool.

On the CPU the kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1``, numpy), for
the tests: far too slow to serve, so the engine never chooses it there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from gateway.engine.attention import AttentionItem
from gateway.engine.kv_sequence import LayerPages

SPLIT_KEYS = 512
"""Key positions per split (split s holds positions s*512..s*512+511): the fold's unit."""

TILE_KEYS = 64
"""Key positions per tile: every score and value product reduces over exactly this many."""

TILE_ROWS = 16
"""Rows of the query tile: one query row's heads that share a KV head, padded with zero rows
(16: the fewest a GPU's matrix product takes; a model with more heads per KV head fails)."""

ADAPTER_PAGE = 64
"""Page size of the transient pool ``attend`` packs gathered buffers into (any size gives the
same bits: the kernel's tiles do not follow pages)."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def numerics_name(split_keys: int, tile_keys: int, tile_rows: int) -> str:
    """The block-namespace part of a kernel with these shapes (other shapes, other bits)."""
    return f"tri-s{split_keys}n{tile_keys}m{tile_rows}"


NUMERICS = numerics_name(SPLIT_KEYS, TILE_KEYS, TILE_ROWS)
"""The default kernel's part of the block namespace (see ``gateway.engine.attention.NUMERICS``)."""


class TritonPagedAttention:
    """Every query row of a step attended in one Triton launch, K/V read through block tables.

    Args:
        split_keys: key positions per split (a multiple of ``tile_keys``).
        tile_keys: key positions per tile (a power of two; 16 or more on a GPU).
        tile_rows: rows of the query tile: the query heads sharing a KV head, padded with
            zero rows (a power of two; 16 or more on a GPU).

    Other shapes are for the interpreted tests, which need many splits over few keys; each
    gives other bits, so ``numerics`` names them.

    Raises (from ``attend``/``attend_paged``):
        ValueError: shapes, dtypes or devices that do not fit, or more query heads per KV
            head than ``tile_rows``.
        RuntimeError: a tensor off CUDA while Triton compiles kernels in this process.
    """

    def __init__(self, *, split_keys: int = SPLIT_KEYS, tile_keys: int = TILE_KEYS,
                 tile_rows: int = TILE_ROWS) -> None:
        for name, value in (("tile_keys", tile_keys), ("tile_rows", tile_rows)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if split_keys < tile_keys or split_keys % tile_keys:
            raise ValueError(f"split_keys ({split_keys}) must be a multiple of tile_keys "
                             f"({tile_keys})")
        self.split_keys = split_keys
        self.tile_keys = tile_keys
        self.tile_rows = tile_rows
        self.numerics = numerics_name(split_keys, tile_keys, tile_rows)

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        """``SequenceAttention.attend``, in one launch: in place where every item's K/V are
        pages of one pool (``LayerPages``, what the forward passes), else with every item's
        K/V packed into a transient pool first (contiguous buffers: tests, oracles). A decode
        row is computed as a prefill row (same kernel, same tile): ``is_decode`` changes
        nothing."""
        if not items:
            return []
        counts = [int(item.queries.shape[0]) for item in items]
        pages = _shared_pages(items)
        key_pages, value_pages, table = pages if pages is not None else _packed_pages(items)
        device = items[0].queries.device
        row_items = torch.repeat_interleave(torch.arange(len(items), dtype=torch.int32),
                                            torch.tensor(counts)).to(device)
        attended = self.attend_paged(
            torch.cat([item.queries for item in items]), key_pages, value_pages, table,
            torch.cat([item.positions for item in items]), row_items)
        return list(torch.split(attended, counts))

    def attend_paged(self, queries: torch.Tensor, key_pages: torch.Tensor,
                     value_pages: torch.Tensor, table: torch.Tensor, positions: torch.Tensor,
                     row_items: torch.Tensor) -> torch.Tensor:
        """Every row's attention over its own sequence's keys up to its position, one launch.

        Args:
            queries: ``[rows, heads, head_dim]`` (RoPE applied), heads = kv_heads * rep.
            key_pages: one layer's K of the pool, ``[kv_heads, pages, page_tokens, head_dim]``
                (``PagePool.storage[layer, 0]``, a view: read in place).
            value_pages: the same layer's V (``storage[layer, 1]``).
            table: int32 ``[sequences, max_pages]``: each sequence's page ids in order,
                padded with 0 (the zero page); only the pages up to a row's position are read.
            positions: ``[rows]``: each row's absolute position in its sequence (the caller
                guarantees its table holds it: nothing checks on the device).
            row_items: ``[rows]``: each row's sequence (its row of ``table``).

        Returns:
            ``[rows, heads, head_dim]`` in the queries' dtype.
        """
        _check(queries, key_pages, value_pages, table, positions, row_items)
        num_rows, num_heads, head_dim = queries.shape
        kv_heads, _, page_tokens, _ = key_pages.shape
        rep = num_heads // kv_heads
        if rep > self.tile_rows:
            raise ValueError(f"{rep} query heads per KV head do not fit tiles of "
                             f"{self.tile_rows} rows")
        out = torch.empty_like(queries, memory_format=torch.contiguous_format)
        if num_rows == 0:
            return out
        from gateway.engine.triton_paged_kernel import kernel, language_interpreted

        interpreted = language_interpreted()
        if not interpreted and queries.device.type != "cuda":
            raise RuntimeError(f"Triton runs kernels on {queries.device.type} only interpreted: "
                               "set TRITON_INTERPRET=1 before triton is first imported")
        kernel()[(num_rows, kv_heads)](
            out, queries, key_pages, value_pages, table, positions, row_items,
            queries.stride(0), queries.stride(1), out.stride(0), out.stride(1),
            key_pages.stride(0), key_pages.stride(1), key_pages.stride(2), table.stride(0),
            1.0 / math.sqrt(head_dim) * math.log2(math.e), REP=rep, HEAD_DIM=head_dim,
            BLOCK_D=max(16, _power_of_two(head_dim)), TILE_ROWS=self.tile_rows,
            TILE_KEYS=self.tile_keys, SPLIT_KEYS=self.split_keys, PAGE=page_tokens,
            DOT_F32=interpreted or queries.dtype == torch.float32)
        return out


def block_table(page_ids: Sequence[Sequence[int]],
                device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 ``[sequences, max_pages]``: each sequence's page ids, padded with the zero page."""
    width = max(1, max((len(ids) for ids in page_ids), default=1))
    rows = [list(ids) + [0] * (width - len(ids)) for ids in page_ids]
    return torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, width)


def triton_attention_problem(device: torch.device) -> str | None:
    """Why ``TritonPagedAttention`` cannot run on ``device`` here, or None.

    On CUDA a tiny launch is compiled and run once per device (a missing compiler, an
    unsupported GPU or a driver too old shows here, not in the first step). On the CPU it runs
    only where Triton interprets kernels (``TRITON_INTERPRET=1`` when triton was first
    imported: the tests), and then nowhere else.
    """
    try:
        from gateway.engine.triton_paged_kernel import language_interpreted
    except ImportError as exc:
        return f"triton is not installed ({exc}); a CUDA build of torch brings it"
    if language_interpreted():
        if device.type == "cpu":
            return None
        return ("Triton interprets kernels in this process (TRITON_INTERPRET=1 when it was "
                "imported): far too slow to serve")
    if device.type == "cuda":
        return _cuda_problem(str(device))
    if device.type == "cpu":
        return ("on the CPU Triton runs kernels only interpreted (TRITON_INTERPRET=1 before "
                "its first import): for tests, far too slow to serve")
    return f"the kernel is written for CUDA, not {device.type}"


@functools.cache
def _cuda_problem(device: str) -> str | None:
    try:
        queries = torch.zeros(1, 2, 16, device=device)
        pages = torch.zeros(1, 2, 16, 16, device=device)
        TritonPagedAttention().attend_paged(
            queries, pages, pages, block_table([[1]], device),
            torch.zeros(1, dtype=torch.long, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))
        torch.cuda.synchronize(device)
    except Exception as exc:  # any failure to compile or launch means: not here
        return f"the Triton kernel does not run on {device}: {type(exc).__name__}: {exc}"
    return None


def _check(queries: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
           table: torch.Tensor, positions: torch.Tensor, row_items: torch.Tensor) -> None:
    """Raise ValueError where the launch's arguments do not fit together."""
    if queries.dim() != 3 or key_pages.dim() != 4 or value_pages.shape != key_pages.shape:
        raise ValueError(f"queries [rows, heads, d] and pages [kv_heads, pages, tokens, d], got "
                         f"{tuple(queries.shape)}, {tuple(key_pages.shape)} and "
                         f"{tuple(value_pages.shape)}")
    num_rows, num_heads, head_dim = queries.shape
    kv_heads = key_pages.shape[0]
    if key_pages.shape[3] != head_dim or num_heads % kv_heads:
        raise ValueError(f"{num_heads} heads of {head_dim} over {kv_heads} KV heads of "
                         f"{key_pages.shape[3]} do not fit")
    if queries.dtype not in DTYPES or {key_pages.dtype, value_pages.dtype} != {queries.dtype}:
        raise ValueError(f"queries and pages must share one of {DTYPES}, got {queries.dtype}, "
                         f"{key_pages.dtype} and {value_pages.dtype}")
    if queries.stride(2) != 1 or key_pages.stride(3) != 1:
        raise ValueError("queries and pages must be contiguous along head_dim")
    if value_pages.stride() != key_pages.stride():
        raise ValueError(f"K and V pages must share their strides (views of one pool), got "
                         f"{key_pages.stride()} and {value_pages.stride()}")
    if table.dtype != torch.int32 or table.dim() != 2 or table.stride(1) != 1:
        raise ValueError(f"the block table must be a row-major int32 [sequences, pages], got "
                         f"{table.dtype} {tuple(table.shape)}")
    if positions.shape != (num_rows,) or row_items.shape != (num_rows,):
        raise ValueError(f"positions and row_items need one entry per row ({num_rows}), got "
                         f"{tuple(positions.shape)} and {tuple(row_items.shape)}")
    devices = {t.device for t in (queries, key_pages, value_pages, table, positions, row_items)}
    if len(devices) > 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")


def _shared_pages(items: Sequence[AttentionItem]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The one pool every item's K/V are pages of, with their block tables as one int32
    table; None where they are not (contiguous buffers, or pages of several pools)."""
    layers = [item.kv for item in items if isinstance(item.kv, LayerPages)]
    if len(layers) < len(items):
        return None
    first = layers[0]
    if any(kv.key_pages.data_ptr() != first.key_pages.data_ptr()
           or kv.value_pages.data_ptr() != first.value_pages.data_ptr()
           or kv.key_pages.shape != first.key_pages.shape for kv in layers):
        return None
    tables = [kv.table.to(torch.int32) for kv in layers]
    table = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    return first.key_pages, first.value_pages, table


def _packed_pages(items: Sequence[AttentionItem]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every item's K/V up to its last position copied into a transient pool of
    ``ADAPTER_PAGE``-token pages (page 0 zero), with the block table of each."""
    keys = [item.kv.keys() for item in items]
    values = [item.kv.values() for item in items]
    kv_heads, _, head_dim = keys[0].shape
    pages = [-(-(int(item.positions.max()) + 1) // ADAPTER_PAGE) for item in items]
    zero_page = keys[0].new_zeros(kv_heads, ADAPTER_PAGE, head_dim)
    shape = (kv_heads, 1 + sum(pages), ADAPTER_PAGE, head_dim)
    key_pages = torch.cat([zero_page] + [_first(k, n * ADAPTER_PAGE)
                                         for k, n in zip(keys, pages, strict=True)], 1)
    value_pages = torch.cat([zero_page] + [_first(v, n * ADAPTER_PAGE)
                                           for v, n in zip(values, pages, strict=True)], 1)
    tables, first_page = [], 1
    for n in pages:
        tables.append(range(first_page, first_page + n))
        first_page += n
    return (key_pages.view(shape), value_pages.view(shape),
            block_table(tables, items[0].queries.device))


def _first(buffer: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` positions of ``[kv_heads, capacity, d]``, zero-padded if shorter."""
    if buffer.shape[1] >= count:
        return buffer[:, :count]
    return torch.nn.functional.pad(buffer, (0, 0, 0, count - buffer.shape[1]))


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
