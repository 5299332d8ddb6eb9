"""Fences on asynchronous copies: when the bytes of a host slot may be written again.

With CUDA, the host tier copies a block from its pinned slot to the GPU with
``non_blocking=True``: the call returns once the copy is *queued* on a CUDA stream, and the DMA
engine reads the slot afterwards. If the block is then deleted and its slot handed to another
block, a put could overwrite the slot while the earlier copy is still reading it: the request
that asked first would get the second block's bytes. So every queued copy from a slot records a
fence (a CUDA event on the stream that runs the copy), and a slot given back with unfinished
fences is not reused until they have completed.

``CudaFence`` is that event. On the CPU copies are synchronous and no fence is recorded
(``record_fence`` returns None). ``FenceFactory`` is the seam: tests on a machine without CUDA
inject fences they complete by hand, to prove the pool's rule without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class CopyFence(Protocol):
    """Marks the point of a stream after a queued copy."""

    def is_done(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        ...

    def wait(self) -> None:
        """Block until the copy has finished."""
        ...


FenceFactory = Callable[[torch.device], "CopyFence | None"]
"""Records a fence after the work queued so far on ``device``'s current stream (None: the
copies to or from ``device`` are synchronous, nothing to wait for)."""


class CudaFence:
    """A CUDA event recorded on ``device``'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(device))

    def is_done(self) -> bool:
        return bool(self._event.query())  # type: ignore[no-untyped-call]

    def wait(self) -> None:
        self._event.synchronize()


def record_fence(device: torch.device) -> CopyFence | None:
    """A ``CudaFence`` on ``device`` if it is a CUDA device, else None (synchronous copies)."""
    if device.type != "cuda":
        return None
    return CudaFence(device)
