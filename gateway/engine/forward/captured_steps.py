"""Steps run from static buffers, replayed as CUDA graphs: one launch a step, not thousands.

Why: on a GPU a decode step, or a warm request's short suffix, is a few milliseconds of
arithmetic behind thousands of kernel launches and the Python that issues them (docs/gpu.md).
vLLM and SGLang capture their decode steps as CUDA graphs, one per padded batch size, and
replay them with the block tables and lengths rewritten in static buffers. kvgate's steps
already have fixed shapes where decode rows share the product
(``RowProducts.shares_decode_rows``: cuBLAS on a GPU, oneDNN on a CPU): every row of a step,
decode and prefill alike, is in one product padded to ``RowPadding.rows_for(n)`` rows, and the
logits rows to ``rows_for(wanted)``: counts whose rows the start-up search and probe checked.
So a step of up to ``max_rows`` rows is a bucket here, keyed by those two padded counts and by
how far its positions reach (a power of two: the block tables' width and the attention's
splits); every bucket lies inside the invariance class the probe passed, and no row is padded
further than the eager forward pads it.

What a bucket holds: the rows' token ids, positions and K/V slots, the logits rows, each
sequence's block table and the attention's tile plan (``gateway.engine.attention.triton_paged
.TilePlan``: a sequence's rows in tiles aligned by absolute position, each in the slot its
position names), in buffers on the device that never move; a step writes their host images
(pinned) and copies each over once, then replays. Padding rows write their K/V into scratch
pages (held here, never read) and attend position 0 of the zero page, which gives exactly the
zero rows the eager forward joins in their place; unused tiles attend nothing and store
nothing. So a captured step computes the eager forward's bits: the same walk of the weights
(``BatchedForward.run_layers``), the same kernel over the same tiles, the same logits
(``BatchedForward.logits``). The tests check it bit for bit, logits and K/V, in Triton's
interpreter on the CPU and compiled on CUDA; and where it runs, each bucket's first
``CHECKED_STEPS`` steps are run again on the eager forward and compared, logits and K/V,
before the bucket serves: one that differs turns captured steps off (speed lost, never an
answer).

On CUDA a bucket is captured the first time a step needs it (its kernels compiled by two runs
on a side stream first), into one memory pool shared by every bucket; elsewhere (the tests) the
same function runs from the same buffers without a graph. A capture that fails leaves its
bucket running uncaptured, said once in the log. A step this does not cover runs on the eager
forward: more rows than the largest bucket (a long prefill chunk, bound by arithmetic
anyway), sequences of another pool, positions past the model's context.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gateway.engine.attention.triton_paged import TilePlan, TritonPagedAttention
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from tiers.page_pool import Page, PagePool

logger = logging.getLogger(__name__)

MIN_REACH = 2048
"""The shortest reach a bucket is made for: positions below it share one table width."""

CHECKED_STEPS = 2
"""A bucket's first steps checked against the eager forward before it serves: the first is
the one it was captured on, the second the first replay over other inputs (a value the capture
baked in would show there)."""

CAPTURED_PREFILL_ROWS = 256
"""Rows a captured step may have besides one per running request: room for a warm request's
question (a short suffix) beside the decode rows; longer prefill chunks run eagerly."""


@dataclass(frozen=True, slots=True)
class CapturedCounters:
    """What the captured steps did since start (the engine's status shows it).

    Attributes:
        replayed: steps served from a bucket's buffers (a graph replay on CUDA).
        eager: steps served by the eager forward (out of the buckets' reach, or one of a
            bucket's first steps, checked against it).
        captured: buckets captured as CUDA graphs.
        capture_failures: buckets whose capture failed (they run uncaptured).
        verified: buckets whose first ``CHECKED_STEPS`` steps gave the eager forward's bits.
        disabled_because: why no step is captured any more, or None.
    """

    replayed: int = 0
    eager: int = 0
    captured: int = 0
    capture_failures: int = 0
    verified: int = 0
    disabled_because: str | None = None


@dataclass(frozen=True, slots=True, order=True)
class BucketKey:
    """A bucket's fixed shapes: ``rows`` padded rows, ``logit_rows`` padded logits rows (0:
    none wanted), positions below ``reach``."""

    rows: int
    logit_rows: int
    reach: int


def reach_for(end: int, max_positions: int) -> int:
    """The reach of a step whose positions end before ``end``: the smallest power of two at or
    above it and ``MIN_REACH``, but never past ``max_positions``."""
    reach = max(MIN_REACH, 1 << max(0, end - 1).bit_length())
    return min(reach, max_positions)


def captured_steps_problem(forward: Any, device: torch.device) -> str | None:
    """Why steps of ``forward`` cannot run from static buffers on ``device``, or None."""
    if not isinstance(forward, BatchedForward):
        return "the serial route runs one request at a time through transformers"
    if not isinstance(forward.attention, TritonPagedAttention):
        return (f"the {type(forward.attention).__name__} reads K/V per sequence; only the "
                "Triton paged attention reads every row's pages through one table")
    if forward.features.mixers:
        return ("recurrent layers run each sequence from its own state, which a captured step "
                "does not hold")
    if forward.features.has_experts:
        return ("a mixture of experts chooses its products by the tokens' routing, which a "
                "captured step cannot replay")
    if not forward.products.shares_decode_rows:
        return (f"the {forward.products.kernel} products multiply each decode row alone, so a "
                "step has no padded row count to capture")
    if device.type != "cuda":
        return f"CUDA graphs capture GPU work, not {device.type}'s"
    return None


class StepBucket:
    """The static buffers of steps of one ``BucketKey``, and the step run from them.

    Args:
        forward: the eager forward whose weights and numerics the step shares.
        pool: the page pool every sequence of a step reads and writes.
        key: the bucket's shapes.
        scratch_slots: pool slots the padding rows write into (at least ``key.rows``), never
            read.
        rope: the rotary cos and sin of positions below ``key.reach`` on the pool's device
            (shared by the buckets of one reach).
        capture: capture the step as a CUDA graph on first use (else run it from the buffers).
        graph_pool: the CUDA graphs' shared memory pool (None: off CUDA).
        checked_steps: steps checked against the eager forward before it serves.
    """

    def __init__(self, forward: BatchedForward, pool: PagePool, key: BucketKey, *,
                 scratch_slots: Sequence[int], rope: tuple[torch.Tensor, torch.Tensor],
                 capture: bool, graph_pool: Any = None,
                 checked_steps: int = CHECKED_STEPS) -> None:
        attention = forward.attention
        assert isinstance(attention, TritonPagedAttention)
        if len(scratch_slots) < key.rows:
            raise ValueError(f"{len(scratch_slots)} scratch slots cannot take {key.rows} "
                             "padding rows")
        self.key = key
        self._forward = forward
        self._attention = attention
        self._pool = pool
        rows, logit_rows = key.rows, key.logit_rows
        self._tile = tile = attention.shape_for(forward.head_dim).tile_positions
        self._width = width = -(-key.reach // pool.page_tokens)
        # Host images: int64 [ids | positions | slots | logits rows], int32 [logits rows live |
        # tables (a row per sequence, then the zero row padding reads) | plan].
        self._long_host = torch.zeros(3 * rows + logit_rows, dtype=torch.long)
        self._int_host = torch.zeros(logit_rows + (rows + 1) * width + rows * (2 + tile),
                                     dtype=torch.int32)
        self._scratch = np.asarray(scratch_slots[:rows], dtype=np.int64)
        self._unused_tile = np.full(2 + tile, -1, dtype=np.int32)
        self._unused_tile[:2] = (rows, 0)  # the zero table row, no row: attends nothing
        device = pool.device
        if device.type == "cuda":
            self._long_host = self._long_host.pin_memory()
            self._int_host = self._int_host.pin_memory()
        self._longs = self._long_host.to(device)
        self._ints = self._int_host.to(device)
        self._ids, self._positions, self._slots, self._wanted = torch.split(
            self._longs, [rows, rows, rows, logit_rows])
        self._live, tables, plan = torch.split(
            self._ints, [logit_rows, (rows + 1) * width, rows * (2 + tile)])
        self._table = tables.view(rows + 1, width)
        self._plan = TilePlan(plan.view(rows, 2 + tile), rows, key.reach - 1)
        self._cos, self._sin = rope
        self._copied = (torch.cuda.Event()  # type: ignore[no-untyped-call]
                        if device.type == "cuda" else None)
        self._capture = capture
        self._graph_pool = graph_pool
        self._graph: Any = None
        self._logits: torch.Tensor | None = None
        self.capture_failed = False
        self.checks_left = checked_steps
        """Steps still to be checked against the eager forward before this bucket serves."""

    @property
    def is_captured(self) -> bool:
        return self._graph is not None

    @property
    def verified(self) -> bool:
        """Whether its first ``CHECKED_STEPS`` steps gave the eager forward's bits."""
        return self.checks_left == 0

    def run(self, batch: Sequence[SequenceRows], slots: Sequence[np.ndarray]
            ) -> torch.Tensor | None:
        """The float32 logits ``[logit_rows, vocab]`` of a step of ``batch`` (the wanted ones
        first, in order; None where none is wanted), each entry's K/V going to its ``slots``
        (claimed by the caller)."""
        if self._copied is not None:  # the last step's copies have left the host buffers
            self._copied.synchronize()
        self._fill(batch, slots)
        self._pool.await_all()  # a replay reads every layer's pages (tiers.layer_arrivals)
        self._longs.copy_(self._long_host, non_blocking=True)
        self._ints.copy_(self._int_host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return self._replay()

    def _fill(self, batch: Sequence[SequenceRows], slots: Sequence[np.ndarray]) -> None:
        """Write the step's rows, tables and plan into the host images."""
        rows, logit_rows, width, tile = self.key.rows, self.key.logit_rows, self._width, self._tile
        longs = self._long_host.numpy()
        ids, positions, row_slots, wanted = np.split(longs, [rows, 2 * rows, 3 * rows])
        ints = self._int_host.numpy()
        live = ints[:logit_rows]
        table = ints[logit_rows:logit_rows + (rows + 1) * width].reshape(rows + 1, width)
        plan = ints[logit_rows + (rows + 1) * width:].reshape(rows, 2 + tile)
        ids[:] = 0
        positions[:] = 0
        row_slots[:] = self._scratch
        wanted[:] = 0
        live[:] = 0
        table[:] = 0
        plan[:] = self._unused_tile
        row = tiles = picked = 0
        for index, (entry, entry_slots) in enumerate(zip(batch, slots, strict=True)):
            tokens = entry.tokens.reshape(-1)
            n = int(tokens.numel())
            start = entry.sequence.length
            ids[row:row + n] = tokens.cpu().numpy()
            positions[row:row + n] = np.arange(start, start + n)
            row_slots[row:row + n] = entry_slots
            page_ids = entry.sequence.page_ids[:width]  # pages past the reach: never read
            table[index, :len(page_ids)] = page_ids
            for base in range(start - start % tile, start + n, tile):
                first, end = max(base, start), min(base + tile, start + n)
                plan[tiles, :2] = (index, base)
                plan[tiles, 2 + first - base:2 + end - base] = np.arange(
                    row + first - start, row + end - start)
                tiles += 1
            row += n
            if entry.wants_logits:
                wanted[picked] = row - 1
                live[picked] = 1
                picked += 1
        for pad in range(row, rows):  # position 0 of the zero table row: exactly zero
            plan[tiles, 2] = pad
            tiles += 1

    def _replay(self) -> torch.Tensor | None:
        if self._capture and self._graph is None and not self.capture_failed:
            self._capture_graph()
        if self._graph is not None:
            self._graph.replay()
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
            logger.warning("a step of bucket %s could not be captured as a CUDA graph; it "
                           "runs uncaptured", self.key, exc_info=True)
            return
        self._graph, self._logits = graph, logits
        logger.info("captured a step of %d rows, %d logits rows, positions below %d",
                    self.key.rows, self.key.logit_rows, self.key.reach)

    def _step(self) -> torch.Tensor | None:
        """The step, from the buffers alone: every shape fixed, no host read."""
        pool, attention, table, plan = self._pool, self._attention, self._table, self._plan
        slots, forward = self._slots, self._forward
        storage = pool.storage

        def attend(index: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
            pool.scatter(index, slots, k.transpose(0, 1), v.transpose(0, 1))
            features = forward.features.layers[index]
            return attention.attend_planned(q, storage[index, 0], storage[index, 1], table,
                                            plan, features.window, features.attention_scale,
                                            features.logit_softcap, forward.layer_sinks(index))

        cos = self._cos.index_select(0, self._positions)
        sin = self._sin.index_select(0, self._positions)
        hidden = forward.run_layers(self._ids, cos, sin, self.key.rows, attend)
        if not self.key.logit_rows:
            return None
        picked = hidden.index_select(0, self._wanted)
        picked = torch.where((self._live != 0).unsqueeze(1), picked, picked.new_zeros(()))
        return forward.logits(picked, self.key.logit_rows)


class CapturedSteps:
    """A ``StepForward``: steps of up to ``max_rows`` rows from a bucket's static buffers
    (replayed CUDA graphs on a GPU), every other step on the eager forward.

    Args:
        forward: the eager batched forward (Triton attention, decode rows in the shared
            product: ``captured_steps_problem`` says why another cannot).
        pool: the engine's page pool (every running sequence's).
        max_rows: the most rows a captured step may have (the engine's: one per running
            request plus ``CAPTURED_PREFILL_ROWS``).
        max_positions: the model's context (positions the buffers reach at most).
        capture: capture CUDA graphs (True on CUDA); False runs the buckets' steps from their
            buffers without graphs (the tests on the CPU).
        checked_steps: each bucket's first steps checked against the eager forward before it
            serves (``CHECKED_STEPS``; tests that compare every step themselves pass 0).

    Raises:
        PoolExhausted: the pool has no room for the padding rows' scratch pages.
    """

    def __init__(self, forward: BatchedForward, pool: PagePool, *, max_rows: int,
                 max_positions: int, capture: bool, checked_steps: int = CHECKED_STEPS) -> None:
        self._forward = forward
        self._checked_steps = checked_steps
        self._pool = pool
        self._padding = forward.products.padding
        self._largest = self._padding.rows_for(max(1, max_rows))
        self._max_positions = max_positions
        self._capture = capture
        bt = pool.page_tokens
        self._scratch: list[Page] = [pool.allocate() for _ in range(-(-self._largest // bt))]
        self._scratch_slots = [page.id * bt + offset for page in self._scratch
                               for offset in range(bt)]
        self._graph_pool = torch.cuda.graph_pool_handle() if capture else None
        self._buckets: dict[BucketKey, StepBucket] = {}
        self._ropes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._replayed = self._eager = 0
        self.disabled_because: str | None = None
        """Why no step is captured any more (a bucket's checked step differed), or None."""

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
            capture_failures=sum(1 for b in buckets if b.capture_failed),
            verified=sum(1 for b in buckets if b.verified),
            disabled_because=self.disabled_because)

    def forward(self, batch: Sequence[SequenceRows]) -> list[torch.Tensor | None]:
        """``StepForward.forward``: a step within reach from its bucket, any other on the
        eager forward (the same bits either way: a bucket's first steps are checked)."""
        key = self._key(batch) if self.disabled_because is None else None
        if key is None:
            self._eager += 1
            return self._forward.forward(batch)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = StepBucket(self._forward, self._pool, key, capture=self._capture,
                                scratch_slots=self._scratch_slots, rope=self._rope(key.reach),
                                graph_pool=self._graph_pool, checked_steps=self._checked_steps)
            self._buckets[key] = bucket
        slots = [entry.sequence.claim(int(entry.tokens.numel())).numpy() for entry in batch]
        logits = bucket.run(batch, slots)
        out: list[torch.Tensor | None] = []
        picked = 0
        for entry in batch:
            if entry.wants_logits:
                assert logits is not None
                out.append(logits[picked].clone())
                picked += 1
            else:
                out.append(None)
        if not bucket.verified:
            return self._verify(bucket, batch, slots, out)
        for entry in batch:
            entry.sequence.advance(int(entry.tokens.numel()))
        self._replayed += 1
        return out

    def _verify(self, bucket: StepBucket, batch: Sequence[SequenceRows],
                slots: Sequence[np.ndarray], captured: list[torch.Tensor | None]
                ) -> list[torch.Tensor | None]:
        """A step of a bucket not yet verified, run again on the eager forward over the same
        slots (which rewrites the step's K/V before any row reads them): the bucket serves once
        ``CHECKED_STEPS`` of its steps gave the eager forward's logits and K/V bit for bit; one
        that differs turns captured steps off, and its answer is the eager forward's."""
        written = torch.from_numpy(np.concatenate(slots)).to(self._pool.device)
        kv = self._pool.storage.flatten(3, 4).index_select(3, written)
        expected = self._forward.forward(batch)
        same = torch.equal(kv, self._pool.storage.flatten(3, 4).index_select(3, written))
        same = same and all((a is None) == (b is None) and (a is None or b is None
                                                             or torch.equal(a, b))
                            for a, b in zip(captured, expected, strict=True))
        self._eager += 1
        if same:
            bucket.checks_left -= 1
        else:
            self.disabled_because = (f"a step of bucket {bucket.key} gave other bits than the "
                                     "eager forward")
            logger.error("captured steps turned off: %s; every step runs eagerly from now on",
                         self.disabled_because)
        return expected

    def _rope(self, reach: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary cos and sin of positions below ``reach`` on the pool's device, one copy
        per reach (a 128k-token reach of a 128-wide head is 64 MiB in bfloat16)."""
        tables = self._ropes.get(reach)
        if tables is None:
            cos, sin = self._forward.rope_tables(reach)
            device = self._pool.device
            tables = (cos[:reach].to(device), sin[:reach].to(device))
            self._ropes[reach] = tables
        return tables

    def _key(self, batch: Sequence[SequenceRows]) -> BucketKey | None:
        """The bucket of ``batch``, or None where it runs eagerly."""
        if not batch:
            return None
        num_rows = end = num_wanted = 0
        for entry in batch:
            seq, n = entry.sequence, int(entry.tokens.numel())
            if (n < 1 or (entry.is_decode and n != 1) or seq.pool is not self._pool
                    or seq.length + n > min(seq.capacity, self._max_positions)):
                return None  # the eager forward refuses what it must
            num_rows += n
            end = max(end, seq.length + n)
            num_wanted += entry.wants_logits
        if num_rows > self._largest:
            return None
        return BucketKey(rows=self._padding.rows_for(num_rows),
                         logit_rows=self._padding.rows_for(num_wanted),
                         reach=reach_for(end, self._max_positions))
