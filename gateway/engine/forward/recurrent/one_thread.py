"""The recurrent layers' per-sequence arithmetic on one thread.

Why: a scan's chunk is a few dozen small tensor operations (``[heads, 64, 64]`` products,
triangular solves, element-wise steps), each just above the size at which torch splits an
operation over its threads. Where those threads sleep between parallel regions (``kvgate serve``
sets ``OMP_WAIT_POLICY=PASSIVE``: ``gateway.cli.openmp_wait``), and on the engine's own thread,
every such region wakes them: measured on a 2-core Intel Xeon in a thread beside the main one,
a ``[9, 64, 64]`` multiply took 71 us on two threads and 4 us on one, a triangular solve of that
shape 680 us and 60 us, and a Qwen3.5-shaped 2,048-token prefill spent 6.7 of its 8.7 s in its
recurrent layers. Their products in and out stay outside (large, and worth both cores).

Every path of the engine runs this part through ``RecurrentLayers.mix``, so a state's bits come
from one setting however it was reached (cold, warm, probed).

A scan also flushes subnormal numbers to zero (``subnormals_flushed``): its decays
``exp(cum_i - cum_j)`` over a chunk, and states decaying towards zero, fall below float32's
normal range, and an x86 core takes a slow assist for every such operand -- a Qwen3.5-shaped
2,048-token prefill spent 3.2 s in its scans with them and 1.2 s flushed (the same 2-core Xeon).
What a flushed number would have added is below 1e-38. The mode is a core's (its MXCSR), so it
is set only where one thread does all the arithmetic: the scan checks that it is alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one inside, as many as before after."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def subnormals_flushed() -> Iterator[None]:
    """Subnormal inputs read as zero and results flushed to zero inside, on this thread (where
    the CPU has the mode: x86; elsewhere as they are), and not after.

    Raises:
        RuntimeError: torch would split an operation over more than this thread, whose other
            threads would compute in the other mode.
    """
    if torch.get_num_threads() != 1:
        raise RuntimeError("subnormals are flushed on one thread only: run inside one_thread()")
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
