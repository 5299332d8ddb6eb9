"""The numerics the model runs in: ``--dtype auto|float32|bfloat16|float16`` (``[server] dtype``).

The dtype decides the weights' precision and the dtype of every K/V tensor the engine computes
and the tiers store, so it is part of every block's namespace: K/V computed in bfloat16 are
never served to a float32 engine, nor the other way round (``gateway.engine.engine``).

``auto`` is bfloat16 on a GPU -- half the memory and bandwidth of float32, tensor-core matmuls,
the dtype models are trained and shipped in -- and float32 on the CPU, where most CPUs have no
native bfloat16 or float16 arithmetic (half precision there is allowed, but slow: it is for
trying out what a GPU deployment will compute, not for serving). Like the device, it is checked
with the rest of the configuration (``dtype_problem``, no torch needed) and resolved once, by
the composition root, right after the device it depends on (``resolve_dtype``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_CHOICES = "auto, float32, bfloat16 or float16"


class DtypeError(ValueError):
    """The configured dtype is not one of ``DTYPES``."""


def dtype_problem(text: object) -> str | None:
    """Why ``text`` is not a dtype setting (None when it is one)."""
    if not isinstance(text, str) or text not in DTYPES:
        return f"server.dtype must be {DTYPE_CHOICES}, got {text!r}"
    return None


def resolve_dtype(text: str, device: torch.device) -> torch.dtype:
    """The torch dtype ``text`` names for a model on ``device``: ``auto`` is bfloat16 on CUDA
    and float32 elsewhere.

    Raises:
        DtypeError: ``text`` is not one of ``DTYPES``.
    """
    import torch  # NOTE: here, not at the top: the loader checks settings without torch

    problem = dtype_problem(text)
    if problem is not None:
        raise DtypeError(problem)
    if text == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype: torch.dtype = getattr(torch, text)
    if device.type == "cpu" and dtype != torch.float32:
        logger.warning("--dtype %s on the CPU: allowed, but slow (most CPUs have no native %s "
                       "arithmetic); float32 is the CPU default", text, text)
    return dtype

