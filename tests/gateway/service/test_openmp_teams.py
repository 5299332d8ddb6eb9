"""While ``kvgate serve`` serves, the engine's thread holds the process's only OpenMP team.

Why it matters: GNU OpenMP counts the workers of every thread's team, and once they outnumber
the CPUs its workers stop spinning between parallel regions, so every region of a step waits
for a worker to wake (docs/benchmarks.md, "One OpenMP team, spinning briefly (issue 45)"). A
thread that holds a team while serving -- the first thread's from start-up, a front or a tier's
writer starting a parallel region -- would bring that back silently. A small library preloaded
into the real ``kvgate serve`` (``openmp_teams.c``) logs when each thread's team begins and
ends; the test serves requests over gRPC and HTTP and reads the log. The model is a tiny Llama
just big enough that start-up work on the first thread runs in parallel (zeroing the page pool's
null page, as SmolLM2's does), so the first thread held a team before serving."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from gateway.client import KvgateClient
from gateway.engine.native.build import compiler
from tests.gateway.cli.test_grpc_cli import _ADDRESSES, GatewayProcess
from tests.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(),
                                reason="thread ids and LD_PRELOAD are Linux's")

SOURCE = Path(__file__).resolve().parent / "openmp_teams.c"


@dataclass(frozen=True)
class Team:
    thread: int
    began_ns: int
    ended_ns: int | None  # None: still held when the process ended

    def held_during(self, start_ns: int, end_ns: int) -> bool:
        return self.began_ns < end_ns and (self.ended_ns is None or self.ended_ns > start_ns)


def _teams(log: Path) -> list[Team]:
    open_teams: dict[int, int] = {}
    teams: list[Team] = []
    for line in log.read_text(encoding="utf-8").splitlines():
        event, thread, at = line.split()
        if event == "begin":
            open_teams[int(thread)] = int(at)
        else:
            teams.append(Team(int(thread), open_teams.pop(int(thread)), int(at)))
    teams.extend(Team(thread, began, None) for thread, began in open_teams.items())
    return teams


@pytest.fixture
def watcher(tmp_path: Path) -> Path:
    library = tmp_path / "openmp_teams.so"
    subprocess.run([compiler(), "-O2", "-shared", "-fPIC", str(SOURCE), "-o", str(library),
                    "-ldl"], check=True, timeout=120)
    return library


@pytest.fixture
def watched(tmp_path: Path, watcher: Path) -> Iterator[tuple[GatewayProcess, Path]]:
    log = tmp_path / "teams.log"
    # 8 layers x 4 KV heads x head_dim 64 x K and V x 16 tokens: a null page of 65,536 floats,
    # past the size from which torch splits a fill over its threads (32,768).
    model = save_tiny_llama(tmp_path / "model", layers=8, kv_heads=4, hidden=256)
    process = GatewayProcess(tmp_path, model,
                             env={"LD_PRELOAD": str(watcher), "OPENMP_TEAMS_LOG": str(log)})
    try:
        yield process, log
    finally:
        process.kill()


def test_only_the_engines_thread_holds_an_openmp_team_while_serving(
        watched: tuple[GatewayProcess, Path]) -> None:
    process, log = watched
    process.start()
    match = _ADDRESSES.search(process.stdout)
    assert match is not None, process.stdout
    key = (process.data_dir / "dev-api-key").read_text(encoding="utf-8").strip()
    serving_from = time.monotonic_ns()
    with KvgateClient("127.0.0.1", process.port, api_key=key) as client:
        for turn in range(3):
            client.generate_text(f"Tell me about the sea, turn {turn}.", max_tokens=8)
    http = openai.OpenAI(base_url=match.group(2), api_key=key)
    http.chat.completions.create(model=process.model_dir.name, max_tokens=8,
                                 messages=[{"role": "user", "content": "And the hills?"}])
    serving_until = time.monotonic_ns()
    code, _ = process.sigterm()
    assert code == 0, process.stderr

    teams = _teams(log)
    assert len({team.thread for team in teams}) > 1, (
        f"the first thread started no team: the test shows nothing ({teams})")
    held = [team for team in teams if team.held_during(serving_from, serving_until)]
    assert len({team.thread for team in held}) == 1, (
        f"teams held while serving: {held}; every team: {teams}")
