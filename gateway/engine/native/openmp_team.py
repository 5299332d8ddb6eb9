"""One OpenMP team in a serving process: the engine's.

Why: GNU OpenMP keeps a team of worker threads for every thread that has started a parallel
region, and it counts the workers of all of them. Once they outnumber the CPUs, every worker
waits with the runtime's *throttled* spin count -- none at all under ``OMP_WAIT_POLICY=PASSIVE``
-- however ``GOMP_SPINCOUNT`` is set. ``kvgate serve`` loads the model and sizes its page pool
on its first thread, which leaves that thread a team; the engine then serves from a thread of
its own with a second team, and on a 2-core machine every one of a step's ~150 regions woke a
sleeping worker. Measured on a 2-core Intel Xeon (3,000 one-row products of a 576 x 576 weight
with a little Python between them, on a second thread, ``GOMP_SPINCOUNT=30000``): 108 us an
iteration at 0.91 cores with the first thread's team alive, 18 us at 2.03 cores once it was
released. Releasing a team is OpenMP 5.0's ``omp_pause_resource_all``, which ends the calling
thread's workers; the next region that thread starts builds a team again.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

RUNTIME_NAMES = ("libgomp", "libiomp5", "libomp")
"""The OpenMP runtimes a torch build loads (GNU's on Linux wheels; Intel's and LLVM's elsewhere),
by the start of their file names."""

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` of OpenMP 5.0's ``omp_pause_resource_t``: end the threads, keep settings."""


def loaded_runtime(maps: Path = Path("/proc/self/maps")) -> Path | None:
    """The file of the OpenMP runtime this process has loaded (torch's), or None: not loaded,
    or no ``/proc`` to tell (not Linux)."""
    try:
        lines = maps.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = Path(fields[5].strip())
        if path.name.startswith(RUNTIME_NAMES) and ".so" in path.name:
            return path
    return None


def release_this_threads_team() -> bool:
    """End the OpenMP workers of the calling thread's team (``omp_pause_resource_all``), so
    that they no longer count against the engine's. True where a runtime was loaded and
    released them; False where there was nothing to release it with (a torch without OpenMP,
    a runtime older than OpenMP 5.0)."""
    runtime = loaded_runtime()
    if runtime is None:
        return False
    try:
        # As the dynamic linker resolves it for the whole process first (where a library
        # preloaded to watch the runtime wraps it, the wrapper), else the runtime's own.
        pause = getattr(ctypes.CDLL(None), "omp_pause_resource_all", None)
        if pause is None:
            pause = ctypes.CDLL(str(runtime)).omp_pause_resource_all
    except (OSError, AttributeError) as exc:
        logger.debug("cannot release OpenMP's threads through %s: %s", runtime, exc)
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    status: int = pause(OMP_PAUSE_SOFT)
    return status == 0
