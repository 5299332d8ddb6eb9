"""Which attention implementation the batched forward uses on a device.

Why a module of its own: the implementations live beside each other (``attention``: the tiled
one, any device; ``flash_attention``: torch's CPU kernel in fixed shapes), and the choice is one
rule, made once per engine. Each is held to the invariance contract and re-checked by the
start-up probe on the real weights.
"""

from __future__ import annotations

import logging

import torch

from gateway.engine.attention import SequenceAttention, TiledAttention
from gateway.engine.flash_attention import FlashBlockAttention, flash_kernel_problem

logger = logging.getLogger(__name__)


def attention_for(device: torch.device, *, decode_as_prefill: bool = False) -> SequenceAttention:
    """The fixed-shape flash attention on a CPU whose torch has the kernel, else the tiled one.

    ``decode_as_prefill``: the forward's projections treat decode rows as prefill rows
    (``gateway.engine.row_products``), so the attention pads a decode row's call to give it a
    prefill's numbers too (``FlashBlockAttention``; the tiled attention computes a row the same
    way on either path).

    NOTE: CUDA has no implementation of its own yet: the tiled one runs there, and the start-up
    probe decides whether it is invariant on that device.
    """
    problem = flash_kernel_problem(device)
    if problem is None:
        return FlashBlockAttention(decode_as_prefill=decode_as_prefill)
    logger.info("attention: tiled (%s)", problem)
    return TiledAttention()
