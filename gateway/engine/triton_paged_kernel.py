"""The Triton kernel of ``gateway.engine.triton_attention``: paged attention in one launch.

Why a module of its own: it imports triton, which a CPU install may lack; only
``triton_attention`` imports it, and only when the kernel is about to run.

One program attends one query row over one KV head: a tile of ``TILE_ROWS`` rows holding that
row's ``rep`` query heads (the rest zero), reading the row's K/V in place from the page pool
through its sequence's block table, up to its own position. What makes its bits its own
(docs/gpu.md, "The Triton paged attention"):

- **every operand is the same in every launch**: a row is never in a tile with other rows
  (NOTE: a tile of several rows would make its bits depend on its slot in the tile -- numpy's
  matmul, which the interpreter runs, gives a row other bits in another slot), the tile shapes
  are constexpr (``TILE_ROWS`` x ``TILE_KEYS`` x head_dim), and keys after the row's position
  are not read (loaded as 0): the kernel computes a row from the same numbers in the same
  order whether it is a decode row, one of a chunk, or one of a batch of many sequences;
- keys are cut into splits of ``SPLIT_KEYS`` positions fixed by absolute position (split s
  holds positions s*SPLIT_KEYS..), each split into tiles of ``TILE_KEYS`` positions; within a
  split the tiles are combined with an online softmax, and the splits' partials (max, weight
  sum, weighted values) are folded left to right by split index, the final max exact;
- a key after the row's position weighs exactly 0 (its score -inf, its weight selected to 0),
  and an all-masked tile or split is an exact identity of the fold (scale 1, plus 0), so what
  a page holds after the row (a later row's key, stale data, junk) never reaches it.

NOTE: a left fold (not a tree, as ``attention.fold_tile_sum``) because a program holds one
running partial, not all of them; it has the property that matters (trailing all-masked
splits add exact zeros), and a kernel that attends the splits in parallel (split-KV, for long
decode rows) can reproduce it bit for bit by folding their partials in the same order.

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


def _paged_attention(out_ptr: tl.tensor, q_ptr: tl.tensor, k_ptr: tl.tensor,
                     v_ptr: tl.tensor, table_ptr: tl.tensor, pos_ptr: tl.tensor,
                     items_ptr: tl.tensor, stride_qr: tl.tensor, stride_qh: tl.tensor,
                     stride_or: tl.tensor, stride_oh: tl.tensor, stride_kvh: tl.tensor,
                     stride_kvp: tl.tensor, stride_kvt: tl.tensor, stride_table: tl.tensor,
                     scale: tl.tensor, REP: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_D: tl.constexpr, TILE_ROWS: tl.constexpr, TILE_KEYS: tl.constexpr,
                     SPLIT_KEYS: tl.constexpr, PAGE: tl.constexpr,
                     DOT_F32: tl.constexpr) -> None:
    """``out[row, head]`` for query row ``program_id(0)`` and the query heads of KV head
    ``program_id(1)``; K and V pages share their strides; ``scale`` is
    1/sqrt(head_dim) * log2(e) (scores in base 2)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    item = tl.load(items_ptr + row).to(tl.int64)
    position = tl.load(pos_ptr + row).to(tl.int32)

    m = tl.arange(0, TILE_ROWS)  # tile row m: query head kv_head * REP + m
    d = tl.arange(0, BLOCK_D)[None, :]
    head = (kv_head * REP + m)[:, None]
    if BLOCK_D == HEAD_DIM:
        q_mask = (m < REP)[:, None]
    else:
        q_mask = (m < REP)[:, None] & (d < HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d, mask=q_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kvh + d
    v_head = v_ptr + kv_head.to(tl.int64) * stride_kvh + d
    table = table_ptr + item * stride_table
    tile_keys = tl.arange(0, TILE_KEYS)

    m_all = tl.full([TILE_ROWS], _NEG_INF, tl.float32)
    l_all = tl.zeros([TILE_ROWS], tl.float32)
    acc_all = tl.zeros([TILE_ROWS, BLOCK_D], tl.float32)
    for split in range(0, position // SPLIT_KEYS + 1):
        split_start = split * SPLIT_KEYS
        m_split = tl.full([TILE_ROWS], _NEG_INF, tl.float32)
        l_split = tl.zeros([TILE_ROWS], tl.float32)
        acc_split = tl.zeros([TILE_ROWS, BLOCK_D], tl.float32)
        for start in range(split_start, tl.minimum(split_start + SPLIT_KEYS, position + 1),
                           TILE_KEYS):
            key = start + tile_keys
            visible = key <= position  # later keys are not even read: loaded as 0
            page = tl.load(table + key // PAGE, mask=visible, other=0).to(tl.int64)
            offset = (page * stride_kvp + (key % PAGE) * stride_kvt)[:, None]
            if BLOCK_D == HEAD_DIM:
                kv_mask = visible[:, None]
            else:
                kv_mask = visible[:, None] & (d < HEAD_DIM)
            k = tl.load(k_head + offset, mask=kv_mask, other=0.0)
            v = tl.load(v_head + offset, mask=kv_mask, other=0.0)
            if DOT_F32:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(visible[None, :], scores * scale, _NEG_INF)
            # The running max is -inf only for padding rows (no query head): 0 keeps their
            # exp2 arguments -inf (weights 0), never -inf - -inf. exp2(-inf) = 0 and
            # exp2(0) = 1 exactly (IEEE; PTX ex2's special cases).
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
            m_split = m_new
        # Fold the split into the running partial, in split order.
        m_new = tl.maximum(m_all, m_split)
        m_safe = tl.where(m_new == _NEG_INF, 0.0, m_new)
        keep = tl.exp2(m_all - m_safe)
        take = tl.exp2(m_split - m_safe)
        l_all = l_all * keep + l_split * take
        acc_all = acc_all * keep[:, None] + acc_split * take[:, None]
        m_all = m_new
    attended = acc_all / tl.where(l_all == 0.0, 1.0, l_all)[:, None]
    tl.store(out_ptr + row * stride_or + head * stride_oh + d,
             attended.to(out_ptr.dtype.element_ty), mask=q_mask)


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
    global _kernel
    with _kernel_lock:
        if _kernel is None:
            with triton.knobs.runtime.scope():
                triton.knobs.runtime.interpret = language_interpreted()
                _kernel = triton.jit(_paged_attention)
        return _kernel
