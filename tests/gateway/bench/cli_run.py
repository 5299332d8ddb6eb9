"""Run a ``kvgate bench`` command as a user runs it, and leave nothing behind if it hangs.

The benchmarks spawn servers of their own (``kvgate serve``, ``redis-server``) and stop them by
pid when they finish. A benchmark killed at the test's timeout never gets to: its servers were
left running, orphaned, for the rest of the test session (seen on a loaded machine). So the
command runs in a process group of its own, and a timeout kills the whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def run_bench(args: list[str], *, timeout_s: float,
              env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -m gateway.cli.main bench ARGS``: its exit status and output.

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s`` (it and every process it started
            have been killed).
    """
    command = [sys.executable, "-m", "gateway.cli.main", "bench", *args]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own group: the benchmark and its servers
            proc.communicate()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
