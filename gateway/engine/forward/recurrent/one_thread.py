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
