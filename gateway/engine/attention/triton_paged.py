"""Paged attention on CUDA: every sequence of a step in one Triton launch per layer.

Why: on a GPU the tiled attention (``gateway.engine.attention.tiled``) costs dozens of small kernel
launches per sequence and layer, and the gather of each sequence's pages (``KVSequence
.key_buffer``) one copy more; the forward is bound by launches, not arithmetic (docs/gpu.md).
Here one launch attends every query row of the step, reading K/V in place from the page pool
(``tiers.page_pool.PagePool.storage``) through each sequence's block table.

It keeps the invariance contract of ``gateway.engine.attention.tiled.SequenceAttention`` by fixed
shapes alone -- tiles of ``TILE_POSITIONS`` query positions aligned by absolute position (a
row's slot in its tile is its position's, however the prompt is chunked), splits of
``SPLIT_KEYS`` key positions fixed by absolute position, tiles of ``TILE_KEYS`` keys, an exact
max, splits folded in the order of their index, keys after a row weighing exactly 0
(``gateway.engine.attention.triton_kernel`` says how) -- so a row's bits never depend on the other
rows of the launch, on how many queries its sequence has, or on how its prompt was chunked.
The start-up probe re-checks it on the device.

Two entry points: ``attend_paged`` is the kernel's own (one layer's K/V pages of the pool, an
int32 block table, per-row positions and sequence index, planned into tiles on the host);
``attend`` adapts the forward's ``AttentionItem``s to it: their ``LayerPages`` are read in
place, while contiguous buffers (tests, oracles) are first packed into a transient pool.

On the CPU the kernel runs only in Triton's interpreter (``TRITON_INTERPRET=1``, numpy), for
the tests: far too slow to serve, so the engine never chooses it there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gateway.engine.attention.tiled import AttentionItem, shared_sinks
from gateway.engine.kv.sequence import LayerPages

SPLIT_KEYS = 512
"""Key positions per split (split s holds positions s*512..s*512+511): the fold's unit."""

TILE_KEYS = 64
"""Key positions per tile: every score and value product reduces over exactly this many."""

TILE_POSITIONS = 16
"""Query positions per tile: a tile holds positions base..base+15 of one sequence (base a
multiple of 16), each position's query heads that share a KV head in rows of their own, so a
position always sits in the same rows of its tile however its prompt is chunked."""

ADAPTER_PAGE = 64
"""Page size of the transient pool ``attend`` packs gathered buffers into (any size gives the
same bits: the kernel's tiles do not follow pages)."""

SPLIT_PARALLEL_BELOW = 264
"""Launches of fewer programs than this (two per multiprocessor of an H100) attend their splits
in parallel and fold them in a second launch (decode of a few long sequences); more keep
every split in one program. Both give the same bits (tested), so this is speed only."""

SPLIT_PARALLEL_MAX_BYTES = 64 << 20
"""The most scratch the splits' partials may take (rows x heads x splits x (head_dim + 2)
floats): a few hundred rows over a very long context keep every split in one program rather
than take hundreds of MiB of GPU memory for a step."""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class KernelShape:
    """A kernel's tile shape and launch options (other values, other bits).

    Attributes:
        tile_positions: query positions per tile (a power of two; with the query heads per KV
            head, padded to a power of two, 16 rows or more on a GPU).
        tile_keys: key positions per tile (a power of two; 16 or more on a GPU).
        num_warps: warps per program; None: 4 for tiles of up to 4,096 query elements
            (positions x padded heads x padded head_dim), else 8.
        num_stages: Triton's software-pipelining depth of the key loop; None: its default.
    """

    tile_positions: int = TILE_POSITIONS
    tile_keys: int = TILE_KEYS
    num_warps: int | None = None
    num_stages: int | None = None

    def name(self) -> str:
        name = f"n{self.tile_keys}q{self.tile_positions}"
        if self.num_warps is not None:
            name += f"w{self.num_warps}"
        if self.num_stages is not None:
            name += f"p{self.num_stages}"
        return name


SHAPE_BY_HEAD_DIM = {128: KernelShape(tile_positions=32, tile_keys=128, num_warps=8)}
"""The default kernel's shape for a head size, where it is not ``KernelShape()``: chosen on an
H100 (docs/gpu.md, ``python -m gateway.bench.attention_kernels --variant``): for 128-wide
heads (Llama-3.1-8B) tiles of 32 positions x 128 keys prefill 8k tokens in 2.0 ms a layer
against 4.3 with ``KernelShape()``, decode alike; for 64-wide heads ``KernelShape()`` was the
fastest."""


def _numerics_by_head_dim(split_keys: int) -> str:
    """The block-namespace part of a kernel that takes ``SHAPE_BY_HEAD_DIM``'s shapes."""
    return f"tri2-s{split_keys}" + KernelShape().name() + "".join(
        f"+d{head_dim}{shape.name()}" for head_dim, shape in sorted(SHAPE_BY_HEAD_DIM.items()))


NUMERICS = _numerics_by_head_dim(SPLIT_KEYS)
"""The default kernel's part of the block namespace (see
``gateway.engine.attention.tiled.NUMERICS``): its split size and its shape for each head size (a
model has one)."""


class TritonPagedAttention:
    """Every query row of a step attended in one Triton launch, K/V read through block tables.

    Args:
        split_keys: key positions per split (a multiple of every tile's ``tile_keys``).
        tile_keys, tile_positions, num_warps, num_stages: one ``KernelShape`` for every head
            size (its defaults for those not given); none given: ``SHAPE_BY_HEAD_DIM`` for
            the head size, else ``KernelShape()``.
        split_parallel: True or False to force whether splits run in programs of their own
            (tests); None (the default) decides per launch by its size.

    Other shapes are for the interpreted tests, which need many splits over few keys, and for
    the benchmark's variants; each gives other bits, so ``numerics`` names them.

    Raises (from ``attend``/``attend_paged``):
        ValueError: shapes, dtypes or devices that do not fit.
        RuntimeError: a tensor off CUDA while Triton compiles kernels in this process.
    """

    def __init__(self, *, split_keys: int = SPLIT_KEYS, tile_keys: int | None = None,
                 tile_positions: int | None = None, split_parallel: bool | None = None,
                 num_warps: int | None = None, num_stages: int | None = None) -> None:
        given = (tile_keys, tile_positions, num_warps, num_stages)
        fixed = None
        if any(value is not None for value in given):
            fixed = KernelShape(tile_positions or TILE_POSITIONS, tile_keys or TILE_KEYS,
                                num_warps, num_stages)
        for shape in [fixed] if fixed else [KernelShape(), *SHAPE_BY_HEAD_DIM.values()]:
            for name, value in (("tile_keys", shape.tile_keys),
                                ("tile_positions", shape.tile_positions)):
                if value < 1 or value & (value - 1):
                    raise ValueError(f"{name} must be a power of two, got {value}")
            if split_keys < shape.tile_keys or split_keys % shape.tile_keys:
                raise ValueError(f"split_keys ({split_keys}) must be a multiple of tile_keys "
                                 f"({shape.tile_keys})")
        self.split_keys = split_keys
        self.split_parallel = split_parallel
        self._fixed = fixed
        self.numerics = (_numerics_by_head_dim(split_keys) if fixed is None
                         else f"tri2-s{split_keys}" + fixed.name())
        self._last_plan: tuple[tuple[tuple[int, int], ...], torch.device, int,
                               TilePlan] | None = None
        self._last_table: tuple[tuple[torch.Tensor, ...], torch.Tensor] | None = None

    def shape_for(self, head_dim: int) -> KernelShape:
        """The tile shape and launch options this kernel uses for heads of ``head_dim``."""
        if self._fixed is not None:
            return self._fixed
        return SHAPE_BY_HEAD_DIM.get(head_dim, KernelShape())

    def attend(self, items: Sequence[AttentionItem]) -> list[torch.Tensor]:
        """``SequenceAttention.attend``, in one launch: in place where every item's K/V are
        pages of one pool (``LayerPages``, what the forward passes), else with every item's
        K/V packed into a transient pool first (contiguous buffers: tests, oracles). A decode
        row is computed as a prefill row (same kernel, same tile): ``is_decode`` changes
        nothing. Where every item says its ``first_position`` (the forward's items: consecutive
        positions from there), the plan of a step is made once, for its first layer, and
        reused while the next layers pass the same spans, with no read from the device; the
        joined block table likewise while the items keep the same table tensors."""
        if not items:
            return []
        counts = [int(item.queries.shape[0]) for item in items]
        pages = self._shared_pages(items)
        key_pages, value_pages, table = pages if pages is not None else _packed_pages(items)
        device = items[0].queries.device
        shape = self.shape_for(int(items[0].queries.shape[2]))
        tile = shape.tile_positions
        firsts = [item.first_position for item in items]
        if None in firsts:  # tests, oracles: read their positions
            plan = TilePlan.of(torch.cat([item.positions.cpu() for item in items]),
                               _row_items(counts), tile, device)
        else:
            spans = tuple((int(first or 0), n) for first, n in zip(firsts, counts, strict=True))
            if self._last_plan is not None and self._last_plan[:3] == (spans, device, tile):
                plan = self._last_plan[3]
            else:
                positions = torch.cat([torch.arange(first, first + n) for first, n in spans])
                plan = TilePlan.of(positions, _row_items(counts), tile, device)
                self._last_plan = (spans, device, tile, plan)
        windows = {item.window for item in items}
        scales = {item.scale for item in items}
        if len(windows) > 1 or len(scales) > 1:
            raise ValueError("the items of one layer's attention share its window and scale")
        softcaps = {item.softcap for item in items}
        if len(softcaps) > 1:
            raise ValueError("the items of one layer's attention share its soft-cap")
        attended = self._launch(torch.cat([item.queries for item in items]), key_pages,
                                value_pages, table, plan, shape, windows.pop(), scales.pop(),
                                softcaps.pop(), shared_sinks(items))
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
            positions: ``[rows]``: each row's absolute position in its sequence, no two rows
                of a sequence at one position (the caller guarantees its table holds it:
                nothing checks on the device).
            row_items: ``[rows]``: each row's sequence (its row of ``table``).

        Returns:
            ``[rows, heads, head_dim]`` in the queries' dtype.
        """
        _check(queries, key_pages, value_pages, table, positions, row_items)
        shape = self.shape_for(int(queries.shape[2]))
        plan = TilePlan.of(positions.cpu(), row_items.cpu(), shape.tile_positions,
                           queries.device)
        return self._launch(queries, key_pages, value_pages, table, plan, shape)

    def attend_planned(self, queries: torch.Tensor, key_pages: torch.Tensor,
                       value_pages: torch.Tensor, table: torch.Tensor,
                       plan: TilePlan, window: int | None = None,
                       scale: float | None = None,
                       softcap: float | None = None,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``attend_paged`` for rows planned once with ``TilePlan.of`` in tiles of
        ``shape_for(head_dim).tile_positions`` (benchmarks, and launches repeated over the same
        rows, the captured steps): no host work but the launch; ``window``, ``scale``,
        ``softcap`` and ``sinks`` the layer's (``AttentionItem``'s)."""
        _check(queries, key_pages, value_pages, table)
        shape = self.shape_for(int(queries.shape[2]))
        if plan.tensor.shape[1] != 2 + shape.tile_positions:
            raise ValueError(f"the plan has tiles of {plan.tensor.shape[1] - 2} positions, the "
                             f"kernel {shape.tile_positions} for heads of {queries.shape[2]}")
        return self._launch(queries, key_pages, value_pages, table, plan, shape, window, scale,
                            softcap, sinks)

    def _launch(self, queries: torch.Tensor, key_pages: torch.Tensor,
                value_pages: torch.Tensor, table: torch.Tensor, plan: TilePlan,
                shape: KernelShape, window: int | None = None,
                scale: float | None = None,
                softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_rows, num_heads, head_dim = queries.shape
        kv_heads, _, page_tokens, _ = key_pages.shape
        rep = num_heads // kv_heads
        rep_pad = _power_of_two(rep)
        out = torch.empty_like(queries, memory_format=torch.contiguous_format)
        if num_rows == 0:
            return out
        from gateway.engine.attention.triton_kernel import (
            NO_WINDOW,
            kernel,
            language_interpreted,
        )

        interpreted = language_interpreted()
        if not interpreted and queries.device.type != "cuda":
            raise RuntimeError(f"Triton runs kernels on {queries.device.type} only interpreted: "
                               "set TRITON_INTERPRET=1 before triton is first imported")
        block_d = max(16, _power_of_two(head_dim))
        splits = plan.last_position // self.split_keys + 1
        parallel = self.split_parallel
        if parallel is None:
            parallel = splits_apart(num_programs=plan.num_tiles * kv_heads, splits=splits,
                                    scratch_bytes=num_rows * num_heads * splits * (block_d + 2) * 4)
        parts = queries.new_empty((num_rows, num_heads, splits if parallel else 0, block_d + 2),
                                  dtype=torch.float32)
        arguments = (out, queries, key_pages, value_pages, table, plan.tensor, parts,
                     queries.stride(0), queries.stride(1), out.stride(0), out.stride(1),
                     key_pages.stride(0), key_pages.stride(1), key_pages.stride(2),
                     table.stride(0), plan.tensor.stride(0), parts.stride(0), parts.stride(1),
                     parts.stride(2),
                     (1.0 / math.sqrt(head_dim) if scale is None else scale) * math.log2(math.e),
                     NO_WINDOW if window is None else window,
                     # The cap in the kernel's base-2 units (its scores are times log2(e)):
                     # cap * tanh(s / cap) times log2(e) is cap2 * tanh(s2 / cap2).
                     0.0 if softcap is None else softcap * math.log2(math.e),
                     out if sinks is None else _base2_sinks(sinks, queries.device))
        shapes = dict(REP=rep, REP_PAD=rep_pad, QPOS=shape.tile_positions, HEAD_DIM=head_dim,
                      BLOCK_D=block_d, TILE_KEYS=shape.tile_keys, SPLIT_KEYS=self.split_keys,
                      PAGE=page_tokens, DOT_F32=interpreted or queries.dtype == torch.float32,
                      SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
                      num_warps=shape.num_warps or (
                          4 if block_d * shape.tile_positions * rep_pad <= 4096 else 8),
                      enable_fp_fusion=False)
        if shape.num_stages is not None:
            shapes["num_stages"] = shape.num_stages
        run = kernel()
        if parallel:
            run[(plan.num_tiles, kv_heads, splits)](*arguments, PHASE=1, **shapes)
            run[(plan.num_tiles, kv_heads)](*arguments, PHASE=2, **shapes)
        else:
            run[(plan.num_tiles, kv_heads)](*arguments, PHASE=0, **shapes)
        return out

    def _shared_pages(self, items: Sequence[AttentionItem]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The one pool every item's K/V are pages of, with their block tables joined into one
        int32 table (the last join reused while the items keep the same table tensors); None
        where they are not pages of one pool (contiguous buffers, or several pools)."""
        layers = [item.kv for item in items if isinstance(item.kv, LayerPages)]
        if len(layers) < len(items):
            return None
        first = layers[0]
        if any(kv.key_pages.data_ptr() != first.key_pages.data_ptr()
               or kv.value_pages.data_ptr() != first.value_pages.data_ptr()
               or kv.key_pages.shape != first.key_pages.shape for kv in layers):
            return None
        tables = tuple(kv.table for kv in layers)
        last = self._last_table
        if (last is not None and len(last[0]) == len(tables)
                and all(a is b for a, b in zip(last[0], tables, strict=True))):
            return first.key_pages, first.value_pages, last[1]
        joined = torch.nn.utils.rnn.pad_sequence([t.to(torch.int32) for t in tables],
                                                 batch_first=True)
        self._last_table = (tables, joined)  # holding them: no other tensor takes their ids
        return first.key_pages, first.value_pages, joined


def splits_apart(*, num_programs: int, splits: int, scratch_bytes: int) -> bool:
    """Whether a launch of ``num_programs`` programs over up to ``splits`` splits attends them
    in programs of their own (speed only: the bits are the same): where the GPU would
    otherwise sit mostly idle, and the partials fit ``SPLIT_PARALLEL_MAX_BYTES``."""
    return (splits > 1 and num_programs < SPLIT_PARALLEL_BELOW
            and scratch_bytes <= SPLIT_PARALLEL_MAX_BYTES)


@dataclass(frozen=True)
class TilePlan:
    """Which query rows each program attends: ``tensor`` is int32 ``[tiles, 2 + positions]``,
    a row ``[sequence, base, row at base, row at base + 1, ...]`` per tile (-1: no row at that
    position), tiles of later positions first (the longest programs start first)."""

    tensor: torch.Tensor
    num_tiles: int
    last_position: int

    @classmethod
    def of(cls, positions: torch.Tensor, row_items: torch.Tensor, tile_positions: int,
           device: torch.device) -> TilePlan:
        """The plan of rows at ``positions`` (CPU) of sequences ``row_items`` (CPU).

        Raises:
            ValueError: two rows of one sequence at one position.
        """
        positions = positions.to(torch.long)
        row_items = row_items.to(torch.long)
        if positions.numel() == 0:
            return cls(torch.zeros(0, 2 + tile_positions, dtype=torch.int32, device=device),
                       0, 0)
        if int(positions.min()) < 0:
            raise ValueError("positions must be >= 0")
        bases = int(positions.max()) // tile_positions + 1
        keys = row_items * bases + positions // tile_positions
        tiles, inverse = torch.unique(keys, return_inverse=True)
        table = torch.full((tiles.numel(), 2 + tile_positions), -1, dtype=torch.int32)
        table[:, 0] = (tiles // bases).to(torch.int32)
        table[:, 1] = (tiles % bases * tile_positions).to(torch.int32)
        cells = inverse * (2 + tile_positions) + 2 + positions % tile_positions
        if torch.unique(cells).numel() < cells.numel():
            raise ValueError("two rows of one sequence at one position")
        table.view(-1)[cells] = torch.arange(positions.numel(), dtype=torch.int32)
        order = torch.argsort(table[:, 1], descending=True, stable=True)
        return cls(table[order].to(device), int(tiles.numel()), int(positions.max()))


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
        from gateway.engine.attention.triton_kernel import language_interpreted
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
           table: torch.Tensor, positions: torch.Tensor | None = None,
           row_items: torch.Tensor | None = None) -> None:
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
    per_row = [t for t in (positions, row_items) if t is not None]
    if any(t.shape != (num_rows,) for t in per_row):
        raise ValueError(f"positions and row_items need one entry per row ({num_rows}), got "
                         f"{[tuple(t.shape) for t in per_row]}")
    devices = {t.device for t in (queries, key_pages, value_pages, table, *per_row)}
    if len(devices) > 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")


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


def _row_items(counts: Sequence[int]) -> torch.Tensor:
    """Each row's item (CPU): ``counts[i]`` rows of item ``i``, in order."""
    return torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))


def _base2_sinks(sinks: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The layer's sinks as the kernel's base-2 scores read them: float32, times log2(e)."""
    return (sinks.to(device=device, dtype=torch.float32) * math.log2(math.e)).contiguous()


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()

