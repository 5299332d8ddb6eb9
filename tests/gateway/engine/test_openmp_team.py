"""Once the engine has started, its thread holds the process's only OpenMP team: the thread that
started it (which loaded the model and sized the pool) has released its own, so GNU OpenMP does
not count those workers against the engine's and throttle their spin
(``gateway.engine.native.openmp_team``).

Each case runs in a process of its own, with two OpenMP threads, so that the teams it counts
are the case's alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gateway.engine.native.openmp_team import loaded_runtime

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="threads are counted through Linux's /proc")

ROOT = Path(__file__).resolve().parents[3]

PRELUDE = textwrap.dedent("""
    import json, os, torch
    torch.set_num_threads(2)

    def threads():
        return set(os.listdir("/proc/self/task"))

    def run_a_parallel_region():
        a = torch.randn(512, 512)
        (a @ a).sum()
""")


def _run(body: str, tmp_path: Path) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT),
           "KVGATE_TEST_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_runtime_torch_loaded_is_found() -> None:
    import torch  # noqa: F401  (loads the runtime)

    runtime = loaded_runtime()
    assert runtime is not None and runtime.exists()


def test_a_released_team_ends_its_workers(tmp_path: Path) -> None:
    result = _run("""
        from gateway.engine.native.openmp_team import release_this_threads_team
        before = threads()
        run_a_parallel_region()
        workers = threads() - before
        released = release_this_threads_team()
        print(json.dumps({"workers": len(workers), "released": released,
                          "left": len(workers & threads())}))
    """, tmp_path)
    assert result == {"workers": 1, "released": True, "left": 0}


def test_starting_the_engine_ends_the_starting_threads_workers(tmp_path: Path) -> None:
    result = _run("""
        from pathlib import Path
        from gateway.engine.models.loading import load_model
        from tests.gateway.engine.parity import make_engine
        from tests.tiny_llama import save_tiny_llama

        tiny = load_model(str(save_tiny_llama(Path(os.environ["KVGATE_TEST_DIR"]) / "model")))
        before = threads()
        run_a_parallel_region()
        workers = threads() - before
        engine = make_engine(tiny, None)
        left = workers & threads()
        engine.stop(grace_s=5)
        print(json.dumps({"workers": len(workers), "left": len(left)}))
    """, tmp_path)
    assert result == {"workers": 1, "left": 0}
