"""``kvgate bench cluster``: kvgate replicas behind SMG, its ``cache_aware`` policy against
``round_robin``, under a chat load with several system-prompt families (issue 27).

Per policy a fresh cluster, all on loopback and stopped by pid: one redis-server, ``--replicas``
``kvgate serve`` processes sharing it (one deployment secret and one tenant key, so that each
reads the blocks the others wrote), and ``smg launch --policy POLICY`` in front of their
OpenAI-compatible ports (SMG, the SGLang model gateway, is not a kvgate dependency: ``make smg``
installs it into ``.venv-smg``). ``--families`` system prompts -- the load's, each under a
heading of its own so that they differ from the first token -- are each chatted by ``--users``
users for ``--rounds`` rounds, every user at once, through SMG, streamed. Per policy: where the
cached prompt tokens came from (a replica's own device and host tiers, or Redis, from kvgate's
usage), TTFT p50/p99, requests per second, the generations each replica finished (its
``kvgate_requests_total``: whether the router balanced them) and TTFT p50 by round (the first
round is cold under every policy); and whether every answer is the same under every policy
(greedy answers must not depend on the replica that computed them).

``--restart-router-after N``: once N requests are answered, SMG is stopped (SIGTERM: it drains
what it has in flight for up to ``--router-drain-s``) and started again on the same port, in
every policy's run. The users' clients send again a request no model saw (``Unanswered``:
refused while SMG is away, a kept-alive connection the old SMG closed, or routed nowhere while
the new one registers its workers), as any client of a restarting router must; the run fails if
a request is answered with an error or an answer is cut. The table says how long SMG was away
and how many requests were sent again.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gateway.bench.chat_workload import system_prompt
from gateway.bench.load import percentile
from gateway.bench.load_clients import ChatSession, HttpSession, run_users
from gateway.bench.peer_serve import StreamedReply
from gateway.bench.rows import BenchError
from gateway.bench.spawn import free_port, redis_on_loopback, spawn_gateway, stop_process
from tiers.kinds.host import HOST

POLICIES = ("cache_aware", "round_robin")
LOCAL_TIERS = ("device", HOST)
"""A replica's own memory: what a router that keeps a family on one replica should serve from."""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SMG_READY = "Activated 1 of 1 worker"
TEAMS = ("Aurora", "Basalt", "Cinder", "Delta", "Ember", "Fjord", "Granite", "Harbor")
"""Family headings: each family's prompt differs from the others' from its first token."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterOptions:
    """What ``kvgate bench cluster`` measures (see ``--help``)."""

    smg: Path
    redis_binary: str
    replicas: int = 3
    families: int = 3
    users: int = 4
    """Users per family."""
    rounds: int = 4
    max_tokens: int = 32
    num_rules: int = 60
    policies: tuple[str, ...] = POLICIES
    model: str = "bundled"
    data_dir: Path = Path("data")
    block_tokens: int = 64
    timeout_s: float = 600.0
    restart_router_after: int = 0
    """Answers before SMG is restarted (0: never)."""
    router_drain_s: float = 30.0
    """SMG's ``--shutdown-grace-period-secs``: how long a stopping SMG waits for what it has
    in flight."""

    def problems(self) -> list[str]:
        """Every unusable option, for one message (SMG itself refuses a policy it lacks)."""
        errors = [f"--{name} must be >= 1" for name in ("replicas", "families", "users", "rounds",
                                                        "max_tokens") if getattr(self, name) < 1]
        if not self.policies:
            errors.append("--policies names no policy")
        num_requests = self.families * self.users * self.rounds
        if self.router_drain_s < 0:
            errors.append(f"--router-drain-s must be >= 0, got {self.router_drain_s:g}")
        if not 0 <= self.restart_router_after < num_requests:
            errors.append(f"--restart-router-after must be in 0..{num_requests - 1} (the run "
                          f"sends {num_requests} requests), got {self.restart_router_after}")
        return errors


@dataclass(slots=True, kw_only=True)
class PolicyResult:
    """One policy's run: every reply, keyed by (user, round), and its wall time."""

    policy: str
    replies: list[StreamedReply] = field(default_factory=list)
    wall_s: float = 0.0
    router_away_s: float | None = None
    """How long the restart took, from SIGTERM to the new SMG's workers ready (None: none)."""
    num_resent: int = 0
    """Requests sent again (once or more) after no model saw them."""
    per_replica: tuple[int, ...] = ()
    """Generations each replica finished (its ``kvgate_requests_total``), in replica order."""

    def answers(self) -> dict[tuple[int, int], str]:
        return {(r.user or 0, r.round_index or 0): r.text for r in self.replies}

    def cached_share(self, tiers: Sequence[str]) -> float | None:
        """Of the cached prompt tokens, the share served from ``tiers`` (None: not reported)."""
        if any(r.cached_by_tier is None for r in self.replies):
            return None
        total = sum(sum((r.cached_by_tier or {}).values()) for r in self.replies)
        local = sum((r.cached_by_tier or {}).get(t, 0) for r in self.replies for t in tiers)
        return local / total if total else None

    @property
    def cached_fraction(self) -> float | None:
        prompt = sum(r.prompt_tokens or 0 for r in self.replies)
        cached = sum(r.cached_tokens or 0 for r in self.replies)
        return cached / prompt if prompt else None


def family_system(family: int, num_rules: int) -> str:
    """Family ``family``'s system prompt: the load's, under a heading that differs from the
    first token (so that a prefix-aware router tells the families apart at once)."""
    return f"{TEAMS[family % len(TEAMS)]} team, desk {family + 1}\n\n" + system_prompt(num_rules)


def run_cluster_benchmark(options: ClusterOptions, *, out: TextIO,
                          err: TextIO) -> list[PolicyResult]:
    """Every policy on a cluster of its own; print the table.

    Raises:
        BenchError: a process did not start, a request failed, or an option is unusable.
    """
    problems = options.problems()
    if problems:
        raise BenchError("; ".join(problems))
    if not os.access(options.smg, os.X_OK):
        raise BenchError(f"{options.smg} is not an smg executable (`make smg` installs one into "
                         ".venv-smg)")
    results = []
    num_users = options.families * options.users
    for policy in options.policies:
        with _cluster(options, policy, err) as (router, api_key, model, http_ports):
            progress = _Progress()
            sessions: list[HttpSession] = []

            def session(port: int = router.port, api_key: str = api_key, model: str = model,
                        progress: _Progress = progress,
                        sessions: list[HttpSession] = sessions) -> ChatSession:
                inner = HttpSession("127.0.0.1", port, max_tokens=options.max_tokens,
                                    timeout_s=options.timeout_s, api_key=api_key, server="smg",
                                    model=model,
                                    resend_within_s=(options.router_drain_s + ROUTER_EXIT_S
                                                     + ROUTER_START_S))
                sessions.append(inner)
                return _Counted(inner, progress)

            restart = None
            if options.restart_router_after:
                restart = _RestartWhen(router, progress, options.restart_router_after, err)
            try:
                replies, wall = run_users(
                    session, num_users=num_users, rounds=options.rounds,
                    system=lambda user: family_system(user % options.families, options.num_rules),
                    num_rules=options.num_rules)
            finally:
                progress.finish()
                away_s = restart.join() if restart is not None else None
            per_replica = tuple(_requests_served(port) for port in http_ports)
        err.write(f"[cluster] {policy}: {len(replies)} requests in {wall:.1f} s\n")
        results.append(PolicyResult(policy=policy, replies=replies, wall_s=wall,
                                    router_away_s=away_s,
                                    num_resent=sum(s.num_resent for s in sessions),
                                    per_replica=per_replica))
    print_table(options, results, out)
    return results


ROUTER_EXIT_S = 30.0
"""How long a stopping SMG may take past its drain before it is killed."""
ROUTER_START_S = 60.0
"""How long a starting SMG may take to route."""


class _Progress:
    """Answers so far, for a thread that waits for the N-th (``_RestartWhen``)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._answered = 0
        self._finished = False

    def answered(self) -> None:
        with self._changed:
            self._answered += 1
            self._changed.notify_all()

    def finish(self) -> None:
        with self._changed:
            self._finished = True
            self._changed.notify_all()

    def wait_for(self, num_answers: int) -> bool:
        """Whether ``num_answers`` came before the run finished."""
        with self._changed:
            self._changed.wait_for(lambda: self._answered >= num_answers or self._finished)
            return self._answered >= num_answers


@dataclass(slots=True)
class _Counted:
    """A user's session that counts its answers in ``progress``."""

    session: HttpSession
    progress: _Progress

    def chat(self, messages: Sequence[dict[str, str]]) -> StreamedReply:
        reply = self.session.chat(messages)
        self.progress.answered()
        return reply

    def close(self) -> None:
        self.session.close()


class _RestartWhen:
    """A thread that restarts ``router`` once ``num_answers`` requests are answered."""

    def __init__(self, router: SmgRouter, progress: _Progress, num_answers: int,
                 err: TextIO) -> None:
        self._away_s: float | None = None
        self._failure: BaseException | None = None

        def run() -> None:
            if not progress.wait_for(num_answers):
                return
            err.write(f"[cluster] {num_answers} answered: restarting smg\n")
            try:
                self._away_s = router.restart()
            except BaseException as exc:  # noqa: BLE001 -- re-raised by join, in the caller
                self._failure = exc
                return
            err.write(f"[cluster] smg serving again after {self._away_s:.1f} s\n")

        self._thread = threading.Thread(target=run, name="router-restart", daemon=True)
        self._thread.start()

    def join(self) -> float | None:
        """How long the router was away (None: the run ended first).

        Raises:
            BenchError: the new SMG did not start.
        """
        self._thread.join()
        if self._failure is not None:
            raise BenchError(f"restarting smg failed: {self._failure}") from self._failure
        return self._away_s


class SmgRouter:
    """SMG on one port, started (and restarted) with the same arguments; each start logs to a
    file of its own under ``root``. ``tests/cluster`` runs its SMG through it too."""

    def __init__(self, smg: Path, port: int, arguments: Sequence[str], *, num_workers: int,
                 root: Path, api_key: str, drain_s: float) -> None:
        self.port = port
        self._api_key = api_key
        self._drain_s = drain_s
        self._command = [str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
                         *arguments, "--shutdown-grace-period-secs", f"{drain_s:g}"]
        self._num_workers = num_workers
        self._root = root
        self._num_starts = 0
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Launch SMG and wait until it routes: every worker activated, and ``/v1/models``
        through it listing a model (SMG listens, and answers 404 ``model_not_found``, a moment
        before it has registered the workers it activated).

        Raises:
            BenchError: it exited, or did not route within a minute.
        """
        log = self._root / f"smg-{self._num_starts}.log"
        self._num_starts += 1
        with log.open("wb") as fh:
            self.proc = subprocess.Popen(self._command, stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ROUTER_START_S
        while (_ANSI.sub("", log.read_text(errors="replace")).count(_SMG_READY)
               < self._num_workers or not _lists_a_model(self.port, self._api_key)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"smg did not register the {self._num_workers} replicas:\n"
                                 + log.read_text(errors="replace")[-2000:])
            time.sleep(0.1)

    def stop(self, grace_s: float) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace_s=grace_s)

    def restart(self) -> float:
        """Stop SMG gracefully, start it again; the seconds it took."""
        began = time.monotonic()
        self.stop(self._drain_s + ROUTER_EXIT_S)
        self.start()
        return time.monotonic() - began


@contextmanager
def _cluster(options: ClusterOptions, policy: str,
             err: TextIO) -> Iterator[tuple[SmgRouter, str, str, list[int]]]:
    """A Redis, the replicas and SMG in front of them; yields SMG, the tenant key, the
    served model's name (which SMG routes by) and the replicas' HTTP ports."""
    api_key = "kvg-bench-" + secrets.token_urlsafe(24)
    # SMG's own key: it lists each worker's models with it, and must differ from the tenant's.
    router_key = "kvg-bench-router-" + secrets.token_urlsafe(24)
    secret = secrets.token_hex(32)
    root = Path(tempfile.mkdtemp(prefix="kvgate-bench-cluster-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        redis_url = stack.enter_context(redis_on_loopback(options.redis_binary, root / "redis"))
        endpoints = [stack.enter_context(spawn_gateway(
            model=options.model, models_dir=options.data_dir / "models",
            block_tokens=options.block_tokens, device_bytes=2 << 30, redis_url=redis_url,
            redis_binary=None, err=err, label=f"cluster-{policy}-{i}", api_key=api_key,
            deployment_secret=secret, other_tenant_keys={"router": router_key}))
            for i in range(options.replicas)]
        if any(e.http_port is None for e in endpoints):
            raise BenchError("a spawned kvgate serve named no HTTP port in its start line")
        router = SmgRouter(options.smg, free_port(), [
            "--worker-urls", *(f"http://127.0.0.1:{e.http_port}" for e in endpoints),
            "--policy", policy, "--api-key", router_key,
            "--tenant-api-key", f"bench:{api_key}", "--disable-tokenizer-autoload",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            num_workers=len(endpoints), root=root, api_key=api_key,
            drain_s=options.router_drain_s)
        # Every request has been answered when it stops: SMG's own graceful drain (5 s) is
        # not needed, so SIGKILL follows SIGTERM after a second.
        stack.callback(router.stop, 1)
        router.start()
        assert router.proc is not None
        err.write(f"[cluster] smg --policy {policy} (pid {router.proc.pid}) on "
                  f"127.0.0.1:{router.port} in front of {len(endpoints)} replicas\n")
        http_ports = [e.http_port for e in endpoints if e.http_port is not None]
        yield router, api_key, _served_model(http_ports[0], api_key), http_ports


def _requests_served(http_port: int) -> int:
    """The generations a replica finished, however they ended: the sum of its
    ``kvgate_requests_total`` series on its API port's ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics",
                                timeout=30) as response:
        text = response.read().decode()
    return round(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("kvgate_requests_total")))


def _lists_a_model(port: int, api_key: str) -> bool:
    """Whether ``/v1/models`` on ``port`` answers with at least one model."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return bool(json.loads(response.read()).get("data"))
    except (OSError, ValueError):  # refused, an error status, or not JSON yet
        return False


def _served_model(http_port: int | None, api_key: str) -> str:
    """The model id a replica's ``/v1/models`` lists first."""
    request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/models",
                                     headers={"Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        models = json.loads(response.read())["data"]
    if not models:
        raise BenchError("a replica's /v1/models lists no model")
    return str(models[0]["id"])


def print_table(options: ClusterOptions, results: Sequence[PolicyResult], out: TextIO) -> None:
    out.write(f"kvgate bench cluster: model {options.model}, {options.replicas} replicas on one "
              f"Redis behind SMG; {options.families} system-prompt families x {options.users} "
              f"users x {options.rounds} rounds x {options.max_tokens} tokens (greedy, "
              "streamed)\n\n")
    out.write(f"{'policy':<14}{'reqs':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'req/s':>8}"
              f"{'cached':>8}{'own memory':>12}{'Redis':>8}  per replica\n" + "-" * 89 + "\n")
    for r in results:
        ttfts = [reply.ttft_s * 1e3 for reply in r.replies]
        own = r.cached_share(LOCAL_TIERS)
        redis = r.cached_share(("redis",))
        cached = r.cached_fraction
        out.write(f"{r.policy:<14}{len(r.replies):>6}{percentile(ttfts, 0.5):>10,.0f}"
                  f"{percentile(ttfts, 0.99):>10,.0f}"
                  f"{len(r.replies) / r.wall_s if r.wall_s else 0.0:>8.2f}"
                  f"{_fraction(cached):>8}{_fraction(own):>12}{_fraction(redis):>8}  "
                  f"{'/'.join(str(n) for n in r.per_replica) or 'n/a'}\n")
    out.write("\n")
    for r in results:
        rounds = sorted({reply.round_index or 0 for reply in r.replies})
        p50s = [percentile([x.ttft_s * 1e3 for x in r.replies if (x.round_index or 0) == i], 0.5)
                for i in rounds]
        out.write(f"{r.policy}: TTFT p50 by round " + " / ".join(f"{p:,.0f}" for p in p50s)
                  + " ms\n")
    num_requests = options.families * options.users * options.rounds
    for r in results:
        if r.router_away_s is not None:
            out.write(f"\n{r.policy}: smg restarted after {options.restart_router_after} "
                      f"answers, away {r.router_away_s:.1f} s; {r.num_resent} requests sent "
                      f"again; {len(r.replies)} of {num_requests} requests answered\n")
    if len(results) > 1:
        first = results[0].answers()
        same = all(r.answers() == first for r in results[1:])
        out.write(f"\nanswers equal under every policy: {'yes' if same else 'NO'}\n")
    out.write("\nTTFT in ms, client side through SMG. cached: cached / prompt tokens. own memory "
              "and Redis: of the cached tokens, the share a replica served from its device and "
              "host tiers, and from Redis (kvgate's usage.kvgate.cached_tokens_by_tier). per "
              "replica: the generations each replica finished (its kvgate_requests_total).\n")


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
