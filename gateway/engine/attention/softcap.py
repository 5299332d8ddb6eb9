"""Logit soft-capping (Gemma 2): a score or a logit ``x`` becomes ``cap * tanh(x / cap)``, a
smooth bound of +-cap that leaves small values almost as they are.

Why a module of its own: the tiled attention caps its scores with it, and the batched forward
its output logits (``DecoderFeatures.final_logit_softcap``); the C and Triton kernels spell the
same formula in their own languages. It is element-wise, so a row's bits depend on that row
alone, as every other step of the forward's.
"""

from __future__ import annotations

import torch


def soft_cap_(values: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``values`` capped in place (divided by ``cap``, tanh, times ``cap``, as transformers'
    Gemma 2 does it); unchanged where ``cap`` is None. Returns ``values``."""
    if cap is not None:
        values.div_(cap).tanh_().mul_(cap)
    return values
