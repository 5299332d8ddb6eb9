"""The Triton kernel of ``gateway.engine.attention.triton_paged``: paged attention in one launch.

Why a module of its own: it imports triton, which a CPU install may lack; only
``triton_attention`` imports it, and only when the kernel is about to run.

One program attends one query tile over one KV head: ``QPOS`` consecutive positions of one
sequence, aligned to ``QPOS`` by absolute position, each position's ``rep`` query heads in
rows of their own (``QPOS * REP_PAD`` rows; absent positions and padding heads are zero rows),
reading the sequence's K/V in place from the page pool through its block table. What makes a
row's bits its own (docs/gpu.md, "The Triton paged attention"):

- **a row always sits in the same slot of the same tile shape**: its tile is fixed by its
  absolute position (``base = position - position % QPOS``), its slot by ``position % QPOS``
  and its head, and every launch has the same constexpr shapes (``QPOS * REP_PAD`` x
  ``TILE_KEYS`` x head_dim). The tile's other slots hold other positions of the same sequence
  or nothing; a matrix product gives a row's numbers from that row and the keys alone (a
  product may give a row other bits in another slot -- numpy's matmul, which the interpreter
  runs, does -- which is why the slot is fixed);
- keys are cut into splits of ``SPLIT_KEYS`` positions fixed by absolute position (split s
  holds positions s*SPLIT_KEYS..), each split into tiles of ``TILE_KEYS`` positions; within a
  split the tiles are combined with an online softmax, and the splits' partials (max, weight
  sum, weighted values) are folded left to right by split index, the final max exact;
- a key after a row's position weighs exactly 0 for it (its score -inf, its weight 0), and an
  all-masked tile or split is an exact identity of the fold (scale 1, plus 0): the keys up to
  the tile's last row are real K/V of the sequence, later ones are not read (loaded as 0), so
  what a page holds after the tile (stale data, junk) never reaches a row, and whether a
  later position shares the row's tile (chunked or one-shot) changes nothing;
- the splits of a long row may run in programs of their own (``PHASE`` 1, partials to a
  scratch buffer) and be folded by a second launch (``PHASE`` 2), through the same functions
  as one program uses (``PHASE`` 0: one loop over key tiles, folding each split as it ends),
  compiled without fused multiply-adds (``enable_fp_fusion=False``) so that every phase
  rounds each operation alike.

NOTE: the interpreter (``TRITON_INTERPRET``) multiplies bfloat16 bit patterns as integers, so
with ``DOT_F32`` (interpreted, or float32 inputs) every product runs in float32 ("ieee": no
TF32 rounding on a GPU); bfloat16 and float16 products on a GPU use the tensor cores.
"""

from __future__ import annotations

import threading
from typing import Any

import triton
import triton.language as tl

_NEG_INF = tl.constexpr(float("-inf"))
"""A score that weighs exactly 0 (a constexpr: a kernel may read no other global)."""

NO_WINDOW = 1 << 30
"""The ``window`` of a layer without one: more positions than any sequence holds."""


def _attend_tile(q: tl.tensor, k_head: tl.tensor, v_head: tl.tensor, table: tl.tensor,
                 start: tl.tensor, last: tl.tensor, position: tl.tensor, d: tl.tensor,
                 scale: tl.tensor, window: tl.tensor, softcap: tl.tensor, m_split: tl.tensor,
                 l_split: tl.tensor, acc_split: tl.tensor, stride_kvp: tl.tensor,
                 stride_kvt: tl.tensor, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 TILE_KEYS: tl.constexpr, PAGE: tl.constexpr, DOT_F32: tl.constexpr,
                 SOFTCAP: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The split's partial (max, weight sum, weighted values) with the key tile at ``start``
    taken in (online softmax).

    With ``SOFTCAP``, each scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` first,
    tanh spelled through ``exp2`` (Triton's language has no tanh its interpreter runs):
    ``tanh(|y|) = (1 - e) / (1 + e)`` with ``e = 2 ** (-2 |y| log2(e))``, its sign restored.
    Element-wise: a score's bits depend on that score alone."""
    key = start + tl.arange(0, TILE_KEYS)
    loaded = key <= last  # keys after the tile's last row are not even read
    page = tl.load(table + key // PAGE, mask=loaded, other=0).to(tl.int64)
    offset = (page * stride_kvp + (key % PAGE) * stride_kvt)[:, None]
    if BLOCK_D == HEAD_DIM:
        kv_mask = loaded[:, None]
    else:
        kv_mask = loaded[:, None] & (d < HEAD_DIM)
    k = tl.load(k_head + offset, mask=kv_mask, other=0.0)
    v = tl.load(v_head + offset, mask=kv_mask, other=0.0)
    if DOT_F32:
        scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    # A key after a row's own position weighs exactly 0 for that row, and so does one before
    # its sliding window (``window``: every position when the layer has none).
    visible = (key[None, :] <= position[:, None]) & (key[None, :] > position[:, None] - window)
    scores = scores * scale
    if SOFTCAP:
        capped = scores / softcap
        e = tl.exp2(tl.abs(capped) * -2.8853900817779268)  # -2 log2(e)
        tanh = (1.0 - e) / (1.0 + e)
        scores = softcap * tl.where(capped < 0.0, -tanh, tanh)
    scores = tl.where(visible, scores, _NEG_INF)
    # The running max is -inf only for rows with no visible key yet: 0 keeps their exp2
    # arguments -inf (weights 0), never -inf - -inf. exp2(-inf) = 0 and exp2(0) = 1 exactly
    # (IEEE; PTX ex2's special cases).
    m_new = tl.maximum(m_split, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = tl.exp2(m_split - m_safe)
    weights = tl.exp2(scores - m_safe[:, None])
    l_split = l_split * alpha + tl.sum(weights, axis=1)
    if DOT_F32:
        # Rounded to the values' dtype first, as a bfloat16 product on a GPU takes them.
        weighted = tl.dot(weights.to(v.dtype).to(tl.float32), v.to(tl.float32),
                          input_precision="ieee")
    else:
        weighted = tl.dot(weights.to(v.dtype), v)
    acc_split = acc_split * alpha[:, None] + weighted
    return m_new, l_split, acc_split


def _fold_split(m_all: tl.tensor, l_all: tl.tensor, acc_all: tl.tensor, m_split: tl.tensor,
                l_split: tl.tensor, acc_split: tl.tensor) -> tuple[tl.tensor, tl.tensor,
                                                                   tl.tensor]:
    """The running partial with a split's partial folded in (the next split in order)."""
    m_new = tl.maximum(m_all, m_split)
    m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
    keep = tl.exp2(m_all - m_safe)
    take = tl.exp2(m_split - m_safe)
    l_all = l_all * keep + l_split * take
    acc_all = acc_all * keep[:, None] + acc_split * take[:, None]
    return m_new, l_all, acc_all


def _paged_attention(out_ptr: tl.tensor, q_ptr: tl.tensor, k_ptr: tl.tensor,
                     v_ptr: tl.tensor, table_ptr: tl.tensor, plan_ptr: tl.tensor,
                     part_ptr: tl.tensor, stride_qr: tl.tensor, stride_qh: tl.tensor,
                     stride_or: tl.tensor, stride_oh: tl.tensor, stride_kvh: tl.tensor,
                     stride_kvp: tl.tensor, stride_kvt: tl.tensor, stride_table: tl.tensor,
                     stride_plan: tl.tensor, stride_pr: tl.tensor, stride_ph: tl.tensor,
                     stride_ps: tl.tensor, scale: tl.tensor, window: tl.tensor,
                     softcap: tl.tensor, sinks_ptr: tl.tensor, REP: tl.constexpr,
                     REP_PAD: tl.constexpr, QPOS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, TILE_KEYS: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                     PAGE: tl.constexpr, PHASE: tl.constexpr, DOT_F32: tl.constexpr,
                     SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr) -> None:
    """The query tile ``program_id(0)`` of the plan over the query heads of KV head
    ``program_id(1)``.

    The plan's row ``t`` is ``[item, base, row of slot 0, ..., row of slot QPOS-1]``: the tile
    holds positions ``base..base+QPOS-1`` (``base`` a multiple of ``QPOS``) of sequence
    ``item``, slot ``s`` the query row at position ``base + s`` or -1. Tile row ``r`` is slot
    ``r // REP_PAD``, query head ``kv_head * REP + r % REP_PAD`` (rows of absent slots and of
    heads past ``REP`` are zero and not stored).

    ``PHASE`` 0 attends every split in this program, in one loop over key tiles that folds
    each split as it ends; 1 computes split ``program_id(2)`` only, its partial (max, weight
    sum, weighted values) to ``part_ptr``; 2 folds those partials. 1 then 2 give the bits of
    0: the same functions take a key tile in and fold a split.

    K and V pages share their strides; ``scale`` is 1/sqrt(head_dim) * log2(e) (base-2
    scores); ``window`` the layer's sliding window (a key ``position - window < key`` is
    visible; ``NO_WINDOW`` where it has none); ``softcap`` the layer's logit soft-cap in the
    same base-2 units (its cap times log2(e); read only where ``SOFTCAP``); ``part_ptr`` is
    ``[rows, heads, splits, BLOCK_D + 2]`` float32 (phases 1 and 2); with ``HAS_SINKS``,
    ``sinks_ptr`` holds the layer's attention sinks ``[heads]``, float32, already times
    log2(e): each row's is folded in last, as one more split whose weight sum is 1 and whose
    values are 0 (a key with no value), so the final max and weight sum include it. A sink is
    never soft-capped (only the scores are).
    """
    tile = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    plan = plan_ptr + tile * stride_plan
    item = tl.load(plan).to(tl.int64)
    base = tl.load(plan + 1)
    r = tl.arange(0, QPOS * REP_PAD)
    slot = r // REP_PAD
    rep = r % REP_PAD
    row = tl.load(plan + 2 + slot)
    valid = (row >= 0) & (rep < REP)
    position = base + slot  # of each tile row
    last = base + tl.max(tl.where(row >= 0, slot, -1), axis=0)  # the tile's last position
    row = tl.where(valid, row, 0).to(tl.int64)

    d = tl.arange(0, BLOCK_D)[None, :]
    head = (kv_head * REP + rep)[:, None]
    if BLOCK_D == HEAD_DIM:
        row_mask = valid[:, None]
    else:
        row_mask = valid[:, None] & (d < HEAD_DIM)
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kvh + d
    v_head = v_ptr + kv_head.to(tl.int64) * stride_kvh + d
    table = table_ptr + item * stride_table
    parts = part_ptr + row * stride_pr + (kv_head * REP + rep) * stride_ph  # [rows]
    if PHASE != 2:
        q = tl.load(q_ptr + row[:, None] * stride_qr + head * stride_qh + d, mask=row_mask,
                    other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)

    m_all = tl.full([QPOS * REP_PAD], _NEG_INF, tl.float32)
    l_all = tl.zeros([QPOS * REP_PAD], tl.float32)
    acc_all = tl.zeros([QPOS * REP_PAD, BLOCK_D], tl.float32)
    m_split = tl.full([QPOS * REP_PAD], _NEG_INF, tl.float32)
    l_split = tl.zeros([QPOS * REP_PAD], tl.float32)
    acc_split = tl.zeros([QPOS * REP_PAD, BLOCK_D], tl.float32)
    if PHASE == 0:
        for start in range(0, last + 1, TILE_KEYS):
            m_split, l_split, acc_split = _attend_tile(
                q, k_head, v_head, table, start, last, position, d, scale, window, softcap,
                m_split, l_split, acc_split, stride_kvp, stride_kvt, HEAD_DIM, BLOCK_D,
                TILE_KEYS, PAGE, DOT_F32, SOFTCAP)
            if ((start + TILE_KEYS) % SPLIT_KEYS == 0) | (start + TILE_KEYS > last):
                m_all, l_all, acc_all = _fold_split(m_all, l_all, acc_all, m_split, l_split,
                                                    acc_split)
                m_split = tl.full([QPOS * REP_PAD], _NEG_INF, tl.float32)
                l_split = tl.zeros([QPOS * REP_PAD], tl.float32)
                acc_split = tl.zeros([QPOS * REP_PAD, BLOCK_D], tl.float32)
    elif PHASE == 1:
        split_start = tl.program_id(2) * SPLIT_KEYS
        if split_start <= last:
            for start in range(split_start, tl.minimum(split_start + SPLIT_KEYS, last + 1),
                               TILE_KEYS):
                m_split, l_split, acc_split = _attend_tile(
                    q, k_head, v_head, table, start, last, position, d, scale, window, softcap,
                    m_split, l_split, acc_split, stride_kvp, stride_kvt, HEAD_DIM, BLOCK_D,
                    TILE_KEYS, PAGE, DOT_F32, SOFTCAP)
            split_part = parts + tl.program_id(2) * stride_ps
            tl.store(split_part[:, None] + d, acc_split, mask=row_mask)
            tl.store(split_part + BLOCK_D, m_split, mask=valid)
            tl.store(split_part + BLOCK_D + 1, l_split, mask=valid)
    else:
        for split in range(0, last // SPLIT_KEYS + 1):
            split_part = parts + split * stride_ps
            acc_split = tl.load(split_part[:, None] + d, mask=row_mask, other=0.0)
            m_split = tl.load(split_part + BLOCK_D, mask=valid, other=0.0)
            l_split = tl.load(split_part + BLOCK_D + 1, mask=valid, other=0.0)
            m_all, l_all, acc_all = _fold_split(m_all, l_all, acc_all, m_split, l_split,
                                                acc_split)
    if PHASE != 1:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + kv_head * REP + rep, mask=valid, other=0.0)
            m_all, l_all, acc_all = _fold_split(
                m_all, l_all, acc_all, sink.to(tl.float32),
                tl.full([QPOS * REP_PAD], 1.0, tl.float32),
                tl.zeros([QPOS * REP_PAD, BLOCK_D], tl.float32))
        attended = acc_all / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
        tl.store(out_ptr + row[:, None] * stride_or + head * stride_oh + d,
                 attended.to(out_ptr.dtype.element_ty), mask=row_mask)


_kernel: Any = None
_kernel_lock = threading.Lock()


def language_interpreted() -> bool:
    """Whether Triton interprets kernels in this process (numpy, any device) instead of
    compiling them (CUDA).

    Triton decides once, when ``triton.language`` is first imported: its own functions
    (``tl.max``, ``tl.sum``, ...) are made by ``@triton.jit``, which reads ``TRITON_INTERPRET``
    at that moment. A kernel of the other mode cannot call them, so this process's mode is
    the only one a kernel here can run in.
    """
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


def kernel() -> Any:
    """The kernel, in this process's mode (``language_interpreted``).

    Why not ``@triton.jit`` at import: the decorator reads ``TRITON_INTERPRET`` when it runs,
    which may no longer be what it was when ``triton.language`` was imported; here the kernel
    is made on first use with the knob set to the language's mode (``knobs.runtime.scope``
    restores it).
    """
    global _kernel, _attend_tile, _fold_split
    with _kernel_lock:
        if _kernel is None:
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = language_interpreted()
                # The helpers the kernel calls, looked up in this module's globals when it
                # compiles or runs: made in the same mode, replacing the plain functions.
                _attend_tile = triton.jit(_attend_tile)
                _fold_split = triton.jit(_fold_split)
                _kernel = triton.jit(_paged_attention)
        return _kernel
