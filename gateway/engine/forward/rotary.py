"""Rotary position embeddings as the batched forward turns q and k: Llama's halves, GLM's
neighbouring pairs, and a head's first part only (a partial rotation).

Why a module of its own: the attention layers of every family turn their heads through these
(the per-head q/k of ``gateway.engine.forward.batched``, the shared rotary key of latent
attention), and each is row-wise: a row's bits are its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Rotation = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``rotate(x, cos, sin)`` of ``x`` ``[rows, heads, d]`` by tables ``[rows, d]``."""


def partially(rotate: Rotation, x: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """``rotate`` of each head's first ``cos.shape[-1]`` numbers, the rest passed as they are
    (a partial rotation, as transformers' GLM and Phi-3 apply it); the whole head where the
    tables are as wide as it. The rotation computes in the tables' dtype and returns ``x``'s:
    OLMo 2's tables stay float32 beside bfloat16 heads, and transformers rotates it so."""
    width = cos.shape[-1]
    if width == x.shape[-1]:
        return rotate(x, cos, sin).to(x.dtype)
    return torch.cat([rotate(x[..., :width], cos, sin).to(x.dtype), x[..., width:]], dim=-1)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[rows, heads, d]`` turning neighbouring pairs
    (2i, 2i + 1) by the i-th frequency (GLM's form: the tables' first half, each entry twice)."""
    half = cos.shape[-1] // 2
    cos = cos[..., :half].repeat_interleave(2, dim=-1)
    sin = sin[..., :half].repeat_interleave(2, dim=-1)
    rotated = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[rows, heads, d]`` (Llama's rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)
