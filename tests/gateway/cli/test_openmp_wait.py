"""``kvgate serve`` lets the engine's OpenMP threads sleep between regions unless the operator
said otherwise, and says so before torch (and its OpenMP runtime) is loaded."""

from __future__ import annotations

import subprocess
import sys

from gateway.cli.openmp_wait import prefer_sleeping_threads


def test_threads_sleep_between_regions_by_default() -> None:
    env: dict[str, str] = {}
    prefer_sleeping_threads(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_an_operators_own_policy_is_kept() -> None:
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    prefer_sleeping_threads(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_command_line_loads_no_torch_before_it_sets_the_policy() -> None:
    """The OpenMP runtime reads the policy once, when torch loads it."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, gateway.cli.main, gateway.cli.bench_run; "
                               "print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "False"
