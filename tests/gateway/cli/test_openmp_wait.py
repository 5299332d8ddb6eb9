"""``kvgate serve`` lets the engine's OpenMP threads spin briefly, then sleep, between regions
unless the operator said otherwise, and says so before torch (and its OpenMP runtime) is
loaded."""

from __future__ import annotations

import subprocess
import sys

from gateway.cli.openmp_wait import spin_briefly_then_sleep


def test_threads_spin_briefly_then_sleep_by_default() -> None:
    env: dict[str, str] = {}
    spin_briefly_then_sleep(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "30000"}


def test_an_operators_own_policy_is_kept_without_a_spin_count_overriding_it() -> None:
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    spin_briefly_then_sleep(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_an_operators_own_spin_count_is_kept() -> None:
    env = {"GOMP_SPINCOUNT": "0"}
    spin_briefly_then_sleep(env)
    assert env == {"GOMP_SPINCOUNT": "0"}


def test_the_command_line_loads_no_torch_before_it_sets_the_policy() -> None:
    """The OpenMP runtime reads the policy once, when torch loads it."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys, gateway.cli.main, gateway.cli.bench_run; "
                               "print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "False"
