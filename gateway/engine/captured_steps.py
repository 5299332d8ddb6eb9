"""Decode steps run from static buffers, replayed as CUDA graphs: one launch a step, not thousands.

Why: on a GPU a decode step of a small model is a millisecond of arithmetic behind a few
thousand kernel launches and the Python that issues them (docs/gpu.md). vLLM and SGLang capture
their decode steps as CUDA graphs, one per padded batch size, and replay them with the block
tables and lengths rewritten in static buffers. kvgate's decode steps already have fixed
shapes where decode rows share the product (``RowProducts.shares_decode_rows``: cuBLAS on a
GPU, oneDNN on a CPU): the step's rows are padded to ``RowPadding.rows_for(n)``, a count whose
rows the start-up search and probe checked, so each padded count is a bucket here -- every
bucket lies inside the invariance class the probe passed, and no row is padded further than
the eager forward pads it.

What a bucket holds: the rows' token ids, positions and K/V slots, each row's block table and
the attention's tile plan (``gateway.engine.triton_attention.TilePlan``: one tile per decode
row, in the slot its position names), in buffers on the device that never move; a step writes
them with two host-to-device copies and replays. Padding rows write their K/V into scratch
pages of their own (held by the bucket, never read) and attend position 0 of the zero page,
which gives exactly the zero rows the eager forward joins in their place, so a captured step
computes the eager forward's bits: the same walk of the weights (``BatchedForward.run_layers``),
the same kernel over the same tiles, the same logits (``BatchedForward.logits``). The tests
check it bit for bit, logits and K/V, in Triton's interpreter on the CPU and compiled on CUDA.

On CUDA a bucket is captured the first time a step needs it (its kernels compiled by two runs
on a side stream first), into one memory pool shared by every bucket; elsewhere (the tests) the
same function runs from the same buffers without a graph. A capture that fails leaves its
bucket running uncaptured, said once in the log. A step this does not cover runs on the
eager forward: prefill rows in it, sequences of another pool, more rows than the largest
bucket, a position past the buffers' reach.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gateway.engine.forward import BatchedForward, SequenceRows
from gateway.engine.triton_attention import TilePlan, TritonPagedAttention
from tiers.page_pool import Page, PagePool

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CapturedCounters:
    """What the captured steps did since start (the engine's status shows it).

    Attributes:
        replayed: decode steps run from a bucket's buffers (a graph replay on CUDA).
        eager: steps handed to the eager forward (prefill rows, or out of the buckets' reach).
        captured: buckets captured as CUDA graphs.
        capture_failures: buckets whose capture failed (they run uncaptured).
    """

    replayed: int = 0
    eager: int = 0
    captured: int = 0
    capture_failures: int = 0


def captured_steps_problem(forward: Any, device: torch.device) -> str | None:
    """Why decode steps of ``forward`` cannot run from static buffers on ``device``, or None."""
    if not isinstance(forward, BatchedForward):
        return "the serial route runs one request at a time through transformers"
    if not isinstance(forward.attention, TritonPagedAttention):
        return (f"the {type(forward.attention).__name__} reads K/V per sequence; only the "
                "Triton paged attention reads every row's pages through one table")
    if not forward.products.shares_decode_rows:
        return (f"the {forward.products.kernel} products multiply each decode row alone, so a "
                "step has no padded row count to capture")
    if device.type != "cuda":
        return f"CUDA graphs capture GPU work, not {device.type}'s"
    return None


class DecodeBucket:
    """The static buffers of decode steps padded to ``rows`` rows, and the step run from them.

    Args:
        forward: the eager forward whose weights and numerics the step shares.
        pool: the page pool every sequence of a step reads and writes.
        rows: the padded row count (a count ``forward.products.padding`` gives).
        max_positions: rows may sit at positions below this (the rotary table and the block
            tables reach that far).
        scratch: pages the padding rows write into (at least ``rows`` slots), never read.
        capture: capture the step as a CUDA graph on first use (else run it from the buffers).
        graph_pool: the CUDA graphs' shared memory pool (None: off CUDA).
    """

    def __init__(self, forward: BatchedForward, pool: PagePool, *, rows: int,
                 max_positions: int, scratch: Sequence[Page], capture: bool,
                 graph_pool: Any = None) -> None:
        attention = forward.attention
        assert isinstance(attention, TritonPagedAttention)
        self.rows = rows
        self.max_positions = max_positions
        self.table_width = -(-max_positions // pool.page_tokens)
        self._forward = forward
        self._attention = attention
        self._pool = pool
        device = pool.device
        tile = attention.shape_for(forward.head_dim).tile_positions
        self._tile = tile
        bt = pool.page_tokens
        scratch_slots = [page.id * bt + offset for page in scratch for offset in range(bt)]
        if len(scratch_slots) < rows:
            raise ValueError(f"{len(scratch)} scratch pages of {bt} tokens cannot take "
                             f"{rows} padding rows")
        # Host images of the buffers: int64 [ids | positions | slots], int32 [live | table |
        # plan]; a step rewrites its rows and copies each image over in one copy.
        self._long_host = torch.zeros(3 * rows, dtype=torch.long)
        self._long_host[2 * rows:] = torch.tensor(scratch_slots[:rows])
        self._scratch_slots = self._long_host[2 * rows:].numpy().copy()
        width = self.table_width
        self._int_host = torch.zeros(rows + rows * width + rows * (2 + tile), dtype=torch.int32)
        plan = self._int_host[rows + rows * width:].view(rows, 2 + tile)
        plan.fill_(-1)
        plan[:, 0] = torch.arange(rows)  # padding tile i: row i at position 0 of table row i,
        plan[:, 1] = 0                   # all zero pages: it attends one zero key, gives 0
        plan[:, 2] = torch.arange(rows)
        self._blank_plan = plan.numpy().copy()
        if device.type == "cuda":
            self._long_host = self._long_host.pin_memory()
            self._int_host = self._int_host.pin_memory()
        self._long_view = self._long_host.numpy().reshape(3, rows)
        self._int_view = self._int_host.numpy()
        self._longs = self._long_host.to(device)
        self._ints = self._int_host.to(device)
        cos, sin = forward.rope_tables(max_positions)
        self._cos = cos[:max_positions].to(device)
        self._sin = sin[:max_positions].to(device)
        self._ids, self._positions, self._slots = self._longs.view(3, rows).unbind(0)
        self._live = self._ints[:rows]
        self._table = self._ints[rows:rows + rows * width].view(rows, width)
        self._plan = TilePlan(self._ints[rows + rows * width:].view(rows, 2 + tile), rows,
                              max_positions - 1)
        self._copied = (torch.cuda.Event()  # type: ignore[no-untyped-call]
                        if device.type == "cuda" else None)
        self._capture = capture
        self._graph_pool = graph_pool
        self._graph: Any = None
        self._logits: torch.Tensor | None = None
        self.capture_failed = False

    @property
    def is_captured(self) -> bool:
        return self._graph is not None

    def run(self, batch: Sequence[SequenceRows], slots: Sequence[int]) -> torch.Tensor:
        """The float32 logits ``[rows, vocab]`` of a decode step of ``batch`` (rows first, in
        order), whose K/V go to pool ``slots`` (claimed by the caller, one per entry)."""
        rows, width, tile = self.rows, self.table_width, self._tile
        if self._copied is not None:  # the last step's copies have left the host buffers
            self._copied.synchronize()
        longs = self._long_view
        ints = self._int_view
        longs[:2] = 0
        longs[2] = self._scratch_slots  # padding rows write where nothing reads
        ints[:rows + rows * width] = 0
        live = ints[:rows]
        table = ints[rows:rows + rows * width].reshape(rows, width)
        plan = ints[rows + rows * width:].reshape(rows, 2 + tile)
        plan[:] = self._blank_plan
        for i, (entry, slot) in enumerate(zip(batch, slots, strict=True)):
            position = entry.sequence.length
            longs[0, i] = int(entry.tokens.reshape(-1)[0])
            longs[1, i] = position
            longs[2, i] = slot
            live[i] = 1
            page_ids = entry.sequence.page_ids
            table[i, :len(page_ids)] = page_ids
            plan[i, 1] = position - position % tile
            plan[i, 2] = -1
            plan[i, 2 + position % tile] = i
        # The copies from pinned memory are ordered before the replay on the same stream.
        self._longs.copy_(self._long_host, non_blocking=True)
        self._ints.copy_(self._int_host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self._replay()

    def _replay(self) -> torch.Tensor:
        if self._capture and self._graph is None and not self.capture_failed:
            self._capture_graph()
        if self._graph is not None:
            self._graph.replay()
            assert self._logits is not None
            return self._logits
        with torch.inference_mode():
            return self._step()

    def _capture_graph(self) -> None:
        """Capture ``_step`` as a CUDA graph (its kernels compiled by two runs first)."""
        device = self._pool.device
        try:
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(2):
                    self._step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._graph_pool,
                                                          capture_error_mode="thread_local"):
                logits = self._step()
        except Exception:  # any failure to capture: the bucket runs uncaptured (same bits)
            self.capture_failed = True
            logger.warning("a decode step of %d rows could not be captured as a CUDA graph; "
                           "it runs uncaptured", self.rows, exc_info=True)
            return
        self._graph, self._logits = graph, logits

    def _step(self) -> torch.Tensor:
        """The step, from the buffers alone: every shape fixed, no host read."""
        pool, attention, table, plan = self._pool, self._attention, self._table, self._plan
        slots = self._slots
        storage = pool.storage

        def attend(index: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            pool.scatter(index, slots, k.transpose(0, 1), v.transpose(0, 1))
            return attention.attend_planned(q, storage[index, 0], storage[index, 1], table,
                                            plan)

        forward = self._forward
        cos = self._cos.index_select(0, self._positions)
        sin = self._sin.index_select(0, self._positions)
        hidden = forward.run_layers(self._ids, cos, sin, self.rows, attend)
        live = (self._live != 0).unsqueeze(1)
        picked = torch.where(live, hidden, hidden.new_zeros(()))
        return forward.logits(picked, self.rows)


class CapturedDecode:
    """A ``StepForward``: decode-only steps from a bucket's static buffers (replayed CUDA
    graphs on a GPU), every other step on the eager forward.

    Args:
        forward: the eager batched forward (Triton attention, decode rows in the shared
            product: ``captured_steps_problem`` says why another cannot).
        pool: the engine's page pool (every running sequence's).
        max_rows: the most decode rows a step can have (the engine's ``max_running``).
        max_positions: the model's context (positions the buffers reach).
        capture: capture CUDA graphs (True on CUDA); False runs the buckets' steps from their
            buffers without graphs (the tests on the CPU).

    Raises:
        PoolExhausted: the pool has no room for the padding rows' scratch pages.
    """

    def __init__(self, forward: BatchedForward, pool: PagePool, *, max_rows: int,
                 max_positions: int, capture: bool) -> None:
        self._forward = forward
        self._pool = pool
        self._padding = forward.products.padding
        self._largest = self._padding.rows_for(max(1, max_rows))
        self._max_positions = max_positions
        self._capture = capture
        self._scratch = [pool.allocate() for _ in range(-(-self._largest // pool.page_tokens))]
        self._graph_pool = torch.cuda.graph_pool_handle() if capture else None
        self._buckets: dict[int, DecodeBucket] = {}
        self._replayed = self._eager = 0

    @property
    def device(self) -> torch.device:
        return self._forward.device

    @property
    def scratch_page_ids(self) -> list[int]:
        """The pages the padding rows write into (held while this lives, never read)."""
        return [page.id for page in self._scratch]

    @property
    def counters(self) -> CapturedCounters:
        """What the captured steps did since start."""
        buckets = self._buckets.values()
        return CapturedCounters(
            replayed=self._replayed, eager=self._eager,
            captured=sum(1 for b in buckets if b.is_captured),
            capture_failures=sum(1 for b in buckets if b.capture_failed))

    def forward(self, batch: Sequence[SequenceRows]) -> list[torch.Tensor | None]:
        """``StepForward.forward``: a decode-only step within reach from its bucket, any other
        on the eager forward (the same bits either way)."""
        if not self._covers(batch):
            self._eager += 1
            return self._forward.forward(batch)
        bucket = self._bucket(self._padding.rows_for(len(batch)))
        slots = [int(entry.sequence.claim(1)[0]) for entry in batch]
        logits = bucket.run(batch, slots)
        for entry in batch:
            entry.sequence.advance(1)
        self._replayed += 1
        return [logits[i].clone() for i in range(len(batch))]

    def _covers(self, batch: Sequence[SequenceRows]) -> bool:
        if not batch or len(batch) > self._largest:
            return False
        bt = self._pool.page_tokens
        width = -(-self._max_positions // bt)
        for entry in batch:
            seq = entry.sequence
            if (not entry.is_decode or not entry.wants_logits or entry.tokens.numel() != 1
                    or seq.pool is not self._pool or seq.length + 1 > seq.capacity
                    or seq.length >= self._max_positions or seq.length // bt >= width):
                return False
        return True

    def _bucket(self, rows: int) -> DecodeBucket:
        bucket = self._buckets.get(rows)
        if bucket is None:
            bucket = DecodeBucket(self._forward, self._pool, rows=rows,
                                  max_positions=self._max_positions, scratch=self._scratch,
                                  capture=self._capture, graph_pool=self._graph_pool)
            self._buckets[rows] = bucket
        return bucket
