"""How many CPU cores a server's process tree used while a load ran (issue 45): a diagnostic
printed beside each row of ``kvgate bench load``, not a target.

A server that leaves a core idle while its users wait has throughput left on the table; one that
keeps every core busy and is still slower spends its cycles worse. Throughput alone cannot tell
the two apart, so each row says ``cores`` = CPU seconds the tree spent / wall seconds.

The CPU seconds are ``utime + stime`` from ``/proc/<pid>/stat`` of the server and every
descendant (vLLM runs its engine in a child process; transformers serve and kvgate in one),
sampled every ``interval_s`` from a thread of the bench: a child that appears during the load
counts from zero, one that exits counts up to its last sample (its time is then in its parent's
``cutime``, which is not read, so it is never counted twice). Processes are keyed by pid and
start time, so that a reused pid is a new process. Linux only: elsewhere the reading is None.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from types import TracebackType

from gateway.bench.process_tree import ProcessKey, process_tree_pids, read_stat


@dataclass(frozen=True, slots=True, kw_only=True)
class CoresUsed:
    """The CPU time a process tree spent over a stretch of wall time."""

    cpu_s: float
    wall_s: float

    @property
    def cores(self) -> float:
        """The average number of cores busy: CPU seconds per wall second."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


def _clock_ticks() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def tree_cpu_ticks(root: int) -> dict[ProcessKey, int]:
    """utime + stime, in clock ticks, of each live process of ``root``'s tree."""
    ticks = {}
    for pid in process_tree_pids(root):
        stat = read_stat(pid)
        if stat is not None:
            ticks[stat.key] = stat.cpu_ticks
    return ticks


class CoresSampler:
    """Samples the CPU time of ``pid``'s process tree from entering to leaving the ``with``.

    ``result`` is None until the block is left, and stays None where ``/proc`` had no reading
    of ``pid`` (not Linux, or the process was gone before the first sample).
    """

    def __init__(self, pid: int, *, interval_s: float = 0.2) -> None:
        self._pid = pid
        self._interval_s = interval_s
        self._first: dict[ProcessKey, int] = {}
        self._last: dict[ProcessKey, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"cores-of-{pid}", daemon=True)
        self._began = 0.0
        self.result: CoresUsed | None = None

    def __enter__(self) -> CoresSampler:
        self._first = tree_cpu_ticks(self._pid)
        self._last = dict(self._first)
        self._began = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        wall = time.perf_counter() - self._began
        if not self._first and not self._last:
            return
        ticks = sum(last - self._first.get(key, 0) for key, last in self._last.items())
        self.result = CoresUsed(cpu_s=ticks / _clock_ticks(), wall_s=wall)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        # Only ever raised: a process's CPU time does not go down, and one that exited keeps
        # the reading it had.
        for key, ticks in tree_cpu_ticks(self._pid).items():
            self._last[key] = max(ticks, self._last.get(key, 0))
