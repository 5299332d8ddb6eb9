"""The cores a server's process tree used during a load (``gateway.bench.cores_used``), read
from /proc against real child processes: one that burns a second of CPU, one that sleeps, and
a parent that only waits while its own child burns (as vLLM's server waits on its engine core).

Each child says when it is ready, waits for the test to say go (so that it does nothing the
sampler has not started to see) and, its work done, holds still, alive, until the test lets it
go, so that every tick it spent is read before it exits.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from gateway.bench.cores_used import CoresSampler, CoresUsed
from gateway.bench.process_tree import process_tree_pids, read_stat

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

_BURN_1S = (
    "import time\n"
    "began = time.process_time()\n"
    "while time.process_time() - began < 1.0:\n"
    "    pass\n"
)
_SAY_DONE_AND_HOLD = "print('done', flush=True)\nimport sys\nsys.stdin.read()\n"
_SAY_READY_AND_WAIT = "print('ready', flush=True)\nimport sys\nsys.stdin.readline()\n"


@contextmanager
def _child(code: str) -> Iterator[subprocess.Popen[str]]:
    """``python -c code`` with a pipe each way; let go (stdin closed) and reaped on leaving."""
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            yield proc
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(timeout=30)


def _read_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


def _say_go(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def test_a_child_burning_a_second_of_cpu_used_most_of_a_core() -> None:
    # The child also says the share of a core it saw itself get (CPU over wall time of its
    # loop): about 1 on a quiet machine, less where other work shares the cores.
    code = (_SAY_READY_AND_WAIT + "import time\nwall = time.perf_counter()\n" + _BURN_1S
            + "print(1.0 / (time.perf_counter() - wall), flush=True)\n" + _SAY_DONE_AND_HOLD)
    with _child(code) as proc:
        assert _read_line(proc) == "ready"
        with CoresSampler(proc.pid, interval_s=0.05) as sampler:
            _say_go(proc)
            own_share = float(_read_line(proc))
            assert _read_line(proc) == "done"
    used = sampler.result
    assert used is not None
    assert 0.95 <= used.cpu_s <= 1.2, used  # its own second, read to the tick
    # What the sampler read is what the child saw (its window is a little wider): > 0.5 on a
    # quiet machine, and no timing assertion on a loaded one.
    assert used.cores >= 0.7 * min(own_share, 1.0), (used, own_share)
    assert used.cores > 0.5 or own_share < 0.7, (used, own_share)


def test_a_sleeping_child_used_about_no_core() -> None:
    code = _SAY_READY_AND_WAIT + "import time\ntime.sleep(1.0)\n" + _SAY_DONE_AND_HOLD
    with _child(code) as proc:
        assert _read_line(proc) == "ready"
        with CoresSampler(proc.pid, interval_s=0.05) as sampler:
            _say_go(proc)
            assert _read_line(proc) == "done"
    used = sampler.result
    assert used is not None and used.wall_s >= 1.0  # the sampler saw the whole sleep
    assert used.cores < 0.1, used


def test_a_grandchild_started_during_the_load_counts_for_the_tree() -> None:
    grandchild = "import sys\nsys.stdin.readline()\n" + _BURN_1S + _SAY_DONE_AND_HOLD
    parent = ("print('ready', flush=True)\nimport subprocess, sys\n"
              f"subprocess.run([sys.executable, '-c', {grandchild!r}])\n")
    with _child(parent) as proc:
        assert _read_line(proc) == "ready"
        with CoresSampler(proc.pid, interval_s=0.05) as sampler:
            _say_go(proc)
            assert _read_line(proc) == "done"  # the grandchild's, through the inherited pipe
            assert len(process_tree_pids(proc.pid)) == 2
    used = sampler.result
    assert used is not None
    assert used.cpu_s >= 0.95, used  # the parent only waited: the second is its child's


def test_a_process_that_is_gone_has_no_reading() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert read_stat(proc.pid) is None
    with CoresSampler(proc.pid) as sampler:
        pass
    assert sampler.result is None


def test_cores_are_cpu_seconds_per_wall_second() -> None:
    assert CoresUsed(cpu_s=3.0, wall_s=2.0).cores == 1.5
    assert CoresUsed(cpu_s=1.0, wall_s=0.0).cores == 0.0
