"""Which attention implementation the batched forward uses on a device.

Why a module of its own: the implementations live beside each other (``paged_attention``: the
C kernel reading pages in place, CPU float32; ``attention``: the tiled one, any device;
``flash_attention``: torch's CPU kernel in fixed shapes; ``triton_attention``: the Triton
kernel reading pages in place, CUDA), and the choice is one rule, made once per engine. Each
is held to the invariance contract and re-checked by the start-up probe on the real weights.
"""

from __future__ import annotations

import logging

import torch

from gateway.engine.attention.flash import FlashBlockAttention, flash_kernel_problem
from gateway.engine.attention.paged import PagedAttention, paged_kernel_problem
from gateway.engine.attention.tiled import SequenceAttention, TiledAttention
from gateway.engine.attention.triton_paged import TritonPagedAttention, triton_attention_problem

logger = logging.getLogger(__name__)


def attention_for(device: torch.device, *, dtype: torch.dtype = torch.float32,
                  decode_as_prefill: bool = False) -> SequenceAttention:
    """The Triton kernel on CUDA where it compiles and runs; the paged C kernel on a CPU in
    float32 where it builds; else the fixed-shape flash attention on a CPU whose torch has the
    kernel; else the tiled one.

    ``decode_as_prefill``: the forward's projections treat decode rows as prefill rows
    (``gateway.engine.linear.row_products``), so the attention pads a decode row's call to give it a
    prefill's numbers too (``FlashBlockAttention``; the tiled attention computes a row the same
    way on either path).

    NOTE: on CUDA the start-up probe decides whether the Triton kernel (or else the tiled one)
    is invariant on that device. The Triton kernel computes a decode row as a prefill row
    whatever ``decode_as_prefill`` says.
    """
    if device.type == "cuda":
        triton_problem = triton_attention_problem(device)
        if triton_problem is None:
            return TritonPagedAttention()
        logger.info("attention: not Triton (%s)", triton_problem)
    paged_problem = paged_kernel_problem(device, dtype)
    if paged_problem is None:
        return PagedAttention()
    logger.info("attention: not paged (%s)", paged_problem)
    problem = flash_kernel_problem(device)
    if problem is None:
        return FlashBlockAttention(decode_as_prefill=decode_as_prefill)
    logger.info("attention: tiled (%s)", problem)
    return TiledAttention()
