"""``kvgate bench cluster`` end to end at tiny scale: the real CLI, one real ``kvgate serve``
replica on a real redis-server behind a real SMG, per policy (routing among several replicas is
tests/cluster's), the tiny Llama, 16-token blocks.

SMG is not a kvgate dependency: ``make test`` installs it into ``.venv-smg`` and names it in
``KVGATE_TEST_SMG``; elsewhere the test skips without it. Speed is never asserted -- only that
both policies ran every request, that their answers are the same, that the table reports
where the cached tokens came from, and that SMG restarted mid-run (``--restart-router-after``)
lost none of them (how often a request met the restart depends on the machine's speed;
``test_http_session.py`` holds the resending itself).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.gateway.bench.cli_run import run_bench
from tests.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.slow

SMG = os.environ.get("KVGATE_TEST_SMG") or shutil.which("smg")
ROUNDS = 8
"""Enough for the run to go on past the old SMG's exit on a fast machine."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_both_policies_answer_every_request_alike_through_a_router_restart(
        tiny_model: Path, tmp_path: Path) -> None:
    if SMG is None:
        pytest.skip("smg not found: `make smg`, and KVGATE_TEST_SMG=.venv-smg/bin/smg")
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    done = run_bench(["cluster", "--smg", SMG, "--model", str(tiny_model), "--data-dir",
                      str(tmp_path), "--replicas", "1", "--families", "2", "--users", "1",
                      "--rounds", str(ROUNDS), "--max-tokens", "4", "--rules", "6",
                      "--block-tokens", "16", "--timeout", "60", "--restart-router-after", "2",
                      "--router-drain-s", "1"], timeout_s=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {m.group(1): m.group(2).split() for m in re.finditer(
        r"^(cache_aware|round_robin)\s+(.*)$", done.stdout, re.MULTILINE)}
    assert set(rows) == {"cache_aware", "round_robin"}, done.stdout
    for columns in rows.values():
        requests, _, _, _, cached, own, redis, per_replica = columns
        assert int(requests) == 2 * ROUNDS  # 2 families x 1 user
        assert int(per_replica) == 2 * ROUNDS  # the one replica finished each exactly once
        assert 0 < float(cached) <= 1  # each later round reuses its first round's blocks
        assert float(own) + float(redis) <= 1.0001
    restarts = re.findall(r"^(cache_aware|round_robin): smg restarted after 2 answers, away "
                          rf"[\d.]+ s; \d+ requests sent again; {2 * ROUNDS} of {2 * ROUNDS} "
                          "requests answered$", done.stdout, re.MULTILINE)
    assert sorted(restarts) == ["cache_aware", "round_robin"], done.stdout
    assert "answers equal under every policy: yes" in done.stdout
    by_round = re.findall(r"^(cache_aware|round_robin): TTFT p50 by round "
                          r"((?:[\d,]+ / )*[\d,]+) ms$", done.stdout, re.MULTILINE)
    assert {policy: len(p50s.split(" / ")) for policy, p50s in by_round} == {
        "cache_aware": ROUNDS, "round_robin": ROUNDS}, done.stdout


def test_a_missing_smg_is_named_with_how_to_install_it(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    done = run_bench(["cluster", "--smg", str(tmp_path / "no-smg"), "--data-dir", str(tmp_path)],
                     timeout_s=60, env=env)
    assert done.returncode != 0
    assert "is not an smg executable (`make smg` installs one" in done.stderr
