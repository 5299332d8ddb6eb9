"""Two ``kvgate serve`` replicas on one redis-server behind SMG, the SGLang model gateway, with
its ``cache_aware`` policy (issue 27, item 3; docs/scaling-out.md).

SMG is not a kvgate dependency: ``make test`` installs it into a venv of its own
(``.venv-smg``) and names its binary in ``KVGATE_TEST_SMG``; elsewhere put ``smg`` on PATH, or
the test skips.
Everything runs on loopback and is stopped by pid. What it checks: chat answers through SMG
equal one replica's answers asked directly (greedy), each system-prompt family sticks to one
replica (SMG's approximate prefix tree), the tenant's key passes through SMG to kvgate (a
wrong key is kvgate's 401), and later requests of a family are prefix-cache hits; and, with
SMG's sticky sessions keyed by ``X-Session-Id`` (the header that also names kvgate's session),
that a conversation stays on one replica while requests without it are spread.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

import pytest

from gateway.bench.cluster import SmgRouter
from gateway.bench.spawn import stop_process
from tests.redis_harness import RedisServer, free_port
from tests.tiny_llama import save_tiny_llama

pytestmark = pytest.mark.slow

KVGATE = str(Path(sys.executable).parent / "kvgate")
SMG = os.environ.get("KVGATE_TEST_SMG") or shutil.which("smg")
TENANT_KEY = "kvg-smg-tenant-Xw4Pd9Nq2Lc7Bv5Mz1Kh8Ra3"
ROUTER_KEY = "kvg-smg-router-Jt6Ey0Sg3Fu8Ho2Ci5Wb9Dn4"
"""SMG's ``--api-key``: it asks each worker's ``/v1/models`` with it at registration, and it
also admits clients presenting it; each tenant's key is given again as ``--tenant-api-key``."""
T = TypeVar("T")
_HTTP = re.compile(r"the OpenAI API on http://127\.0\.0\.1:(\d+)/v1")
FAMILIES = ("alpha", "beta")
QUESTIONS = ("one", "two", "three")

CONFIG = """
[grpc]
shutdown_grace_s = 2

[http]
port = 0

[cache]
block_tokens = 16
device_bytes = "64MiB"
host_bytes = 0
disk_bytes = 0
redis_url = "{redis_url}"
redis_timeout_s = 5.0
remote_write = true
# Reuse across replicas is under test, not the load-or-recompute judgement: on a loaded machine
# loopback Redis can measure slower than recomputing the tiny model, and a replica then
# recomputes (0 cached tokens); likewise a 0.25 s read timeout.
skip_slow_tiers = false
"""


CACHE_AWARE = ("--policy", "cache_aware")
STICKY_SESSIONS = ("--policy", "round_robin", "--sticky-sessions",
                   "--routing-key-headers", "x-session-id")
"""Round robin, but a request carrying ``X-Session-Id`` goes where that id went first."""


def _post(url: str, body: dict[str, object], key: str,
          session: str | None = None) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if session is not None:
        headers["X-Session-Id"] = session
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _chat(family: str, question: str) -> dict[str, object]:
    system = (f"[{family}] You are the {family} support assistant of a cloud company; answer "
              "in one sentence, cite nothing, keep every number exact. This preamble spans "
              "several sixteen-token blocks so that a shared prefix has something to share.")
    return {"model": "model", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"question {question}"}]}


class Replica:
    """One ``kvgate serve`` process; its HTTP port is read from its start-up line."""

    def __init__(self, root: Path, config: Path, model: Path, env: dict[str, str]) -> None:
        root.mkdir(parents=True)
        self.err = root / "serve.err"
        with self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [KVGATE, "serve", "--config", str(config), "--port", "0",
                 "--data-dir", str(root / "data"), "--model", str(model)],
                stdout=subprocess.DEVNULL, stderr=err, env=env)
        self.url = ""

    def log(self) -> str:
        return self.err.read_text(encoding="utf-8", errors="replace")

    def wait_serving(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log()
            match = _HTTP.search(self.log())
            if match:
                self.url = f"http://127.0.0.1:{match.group(1)}"
                return
            time.sleep(0.1)
        raise AssertionError(f"replica did not start:\n{self.log()}")

    def num_chats(self) -> int:
        return self.log().count("tenant=tenant-a api=http.chat status=200")


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path,
            redis_server: RedisServer) -> Iterator[tuple[list[Replica], str]]:
    """Two replicas behind SMG with the routing arguments the test names (indirect
    parametrization; ``CACHE_AWARE`` by default)."""
    routing = getattr(request, "param", CACHE_AWARE)
    if SMG is None:
        pytest.skip("smg not found: `pip install smg` into a venv of its own and set "
                    "KVGATE_TEST_SMG to its bin/smg")
    if not os.access(SMG, os.X_OK):
        pytest.fail(f"KVGATE_TEST_SMG names {SMG}, which is not an executable (`make smg` "
                    "installs one into .venv-smg)")
    model = save_tiny_llama(tmp_path / "model")
    config = tmp_path / "kvgate.toml"
    config.write_text(CONFIG.format(redis_url=redis_server.url), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    env.update({"KVGATE_DEPLOYMENT_SECRET": secrets.token_hex(32),
                "KVGATE_API_KEYS": f"{TENANT_KEY}=tenant-a,{ROUTER_KEY}=router"})
    procs: list[subprocess.Popen[bytes]] = []
    router: SmgRouter | None = None
    try:
        replicas = []
        for name in ("a", "b"):
            replica = Replica(tmp_path / name, config, model, env)
            procs.append(replica.proc)
            replicas.append(replica)
        for replica in replicas:
            replica.wait_serving()
        # Started as the bench starts it: ready once it routes (/v1/models through it lists a
        # model), not at its "Activated" log line -- it answers 404 model_not_found between.
        router = SmgRouter(Path(SMG), free_port(), [
            "--worker-urls", *(replica.url for replica in replicas),
            *routing, "--api-key", ROUTER_KEY,
            "--tenant-api-key", f"tenant-a:{TENANT_KEY}",
            "--disable-tokenizer-autoload", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port())],
            num_workers=len(replicas), root=tmp_path, api_key=TENANT_KEY, drain_s=1)
        router.start()
        yield replicas, f"http://127.0.0.1:{router.port}"
    finally:
        # Every request has been answered when it stops: SMG gets a second, the replicas
        # their own graceful stop.
        if router is not None:
            router.stop(1)
        for proc in reversed(procs):
            stop_process(proc, grace_s=10)


def _served_by(replicas: list[Replica], send: Callable[[], T]) -> tuple[int, T]:
    """Which replica answered the request ``send`` makes (its access line counted), and what
    ``send`` returned."""
    before = [replica.num_chats() for replica in replicas]
    sent = send()
    deadline = time.monotonic() + 5  # the access line follows the response
    while (after := [r.num_chats() for r in replicas]) == before:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (index,) = [i for i, (x, y) in enumerate(zip(before, after, strict=True)) if y > x]
    return index, sent


def test_families_stick_to_one_replica_and_answer_as_one_replica_does(
        cluster: tuple[list[Replica], str]) -> None:
    replicas, smg = cluster
    a = replicas[0]
    expected = {}
    for family in FAMILIES:
        for question in QUESTIONS:
            status, body = _post(f"{a.url}/v1/chat/completions", _chat(family, question),
                                 TENANT_KEY)
            assert status == 200, body
            expected[family, question] = body["choices"][0]["message"]["content"]  # type: ignore[index]

    served_by: dict[str, set[int]] = {family: set() for family in FAMILIES}
    cached: list[int] = []
    for family in FAMILIES:
        for question in QUESTIONS:
            index, (status, body) = _served_by(replicas, partial(
                _post, f"{smg}/v1/chat/completions", _chat(family, question), TENANT_KEY))
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == expected[family, question]  # type: ignore[index]
            served_by[family].add(index)
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])  # type: ignore[index]
    assert all(len(indices) == 1 for indices in served_by.values()), served_by
    # every request after a family's first reuses its system prompt's blocks (from the
    # replica's device tier, or from Redis: replica A computed them all once already)
    assert all(tokens >= 16 for tokens in cached), cached

    # the tenant's key passed through SMG as sent (kvgate logged tenant-a, not the router's
    # tenant); a key SMG does not know is refused there, before any replica
    assert all("tenant=router api=http.chat" not in r.log() for r in replicas)
    before = [replica.num_chats() for replica in replicas]
    status, _ = _post(f"{smg}/v1/chat/completions", _chat("alpha", "one"), "wrong-key")
    assert status == 401 and [r.num_chats() for r in replicas] == before


@pytest.mark.parametrize("cluster", [STICKY_SESSIONS], indirect=True)
def test_a_session_header_keeps_a_conversation_on_one_replica(
        cluster: tuple[list[Replica], str]) -> None:
    replicas, smg = cluster

    def ask(question: str, session: str | None) -> dict[str, object]:
        status, body = _post(f"{smg}/v1/chat/completions", _chat("alpha", question),
                             TENANT_KEY, session)
        assert status == 200, body
        return body

    # without the header SMG's round robin spreads the requests over both replicas
    assert {_served_by(replicas, partial(ask, q, None))[0] for q in QUESTIONS[:2]} == {0, 1}
    served_by: dict[str, set[int]] = {"conversation-1": set(), "conversation-2": set()}
    for question in QUESTIONS:
        for session, indices in served_by.items():
            indices.add(_served_by(replicas, partial(ask, question, session))[0])
    assert all(len(indices) == 1 for indices in served_by.values()), served_by
