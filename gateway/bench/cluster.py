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
usage), TTFT p50/p99, requests per second; and whether every answer is the same under every
policy (greedy answers must not depend on the replica that computed them).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gateway.bench.chat_workload import system_prompt
from gateway.bench.load import ChatSession, HttpSession, percentile, run_users
from gateway.bench.peer_serve import StreamedReply
from gateway.bench.rows import BenchError
from gateway.bench.spawn import free_port, redis_on_loopback, spawn_gateway, stop_process

POLICIES = ("cache_aware", "round_robin")
LOCAL_TIERS = ("device", "host")
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

    def problems(self) -> list[str]:
        """Every unusable option, for one message (SMG itself refuses a policy it lacks)."""
        errors = [f"--{name} must be >= 1" for name in ("replicas", "families", "users", "rounds",
                                                        "max_tokens") if getattr(self, name) < 1]
        if not self.policies:
            errors.append("--policies names no policy")
        return errors


@dataclass(slots=True, kw_only=True)
class PolicyResult:
    """One policy's run: every reply, keyed by (user, round), and its wall time."""

    policy: str
    replies: list[StreamedReply] = field(default_factory=list)
    wall_s: float = 0.0

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
        with _cluster(options, policy, err) as (port, api_key, model):
            def session(port: int = port, api_key: str = api_key,
                        model: str = model) -> ChatSession:
                return HttpSession("127.0.0.1", port, max_tokens=options.max_tokens,
                                   timeout_s=options.timeout_s, api_key=api_key, server="smg",
                                   model=model)

            replies, wall = run_users(
                session, num_users=num_users, rounds=options.rounds,
                system=lambda user: family_system(user % options.families, options.num_rules),
                num_rules=options.num_rules)
        err.write(f"[cluster] {policy}: {len(replies)} requests in {wall:.1f} s\n")
        results.append(PolicyResult(policy=policy, replies=replies, wall_s=wall))
    print_table(options, results, out)
    return results


@contextmanager
def _cluster(options: ClusterOptions, policy: str,
             err: TextIO) -> Iterator[tuple[int, str, str]]:
    """A Redis, the replicas and SMG in front of them; yields SMG's port, the tenant key and
    the served model's name (which SMG routes by)."""
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
        port = free_port()
        log = root / "smg.log"
        with log.open("wb") as fh:
            proc = subprocess.Popen(
                [str(options.smg), "launch", "--host", "127.0.0.1", "--port", str(port),
                 "--worker-urls", *(f"http://127.0.0.1:{e.http_port}" for e in endpoints),
                 "--policy", policy, "--api-key", router_key,
                 "--tenant-api-key", f"bench:{api_key}", "--disable-tokenizer-autoload",
                 "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
                stdout=fh, stderr=subprocess.STDOUT)
        # Every request has been answered when it stops: SMG's own graceful drain (5 s) is
        # not needed, so SIGKILL follows SIGTERM after a second.
        stack.callback(stop_process, proc, grace_s=1)
        deadline = time.monotonic() + 60
        while _ANSI.sub("", log.read_text(errors="replace")).count(_SMG_READY) < len(endpoints):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"smg did not register the {len(endpoints)} replicas:\n"
                                 + log.read_text(errors="replace")[-2000:])
            time.sleep(0.2)
        err.write(f"[cluster] smg --policy {policy} (pid {proc.pid}) on 127.0.0.1:{port} in "
                  f"front of {len(endpoints)} replicas\n")
        yield port, api_key, _served_model(endpoints[0].http_port, api_key)


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
              f"{'cached':>8}{'own memory':>12}{'Redis':>8}\n" + "-" * 76 + "\n")
    for r in results:
        ttfts = [reply.ttft_s * 1e3 for reply in r.replies]
        own = r.cached_share(LOCAL_TIERS)
        redis = r.cached_share(("redis",))
        cached = r.cached_fraction
        out.write(f"{r.policy:<14}{len(r.replies):>6}{percentile(ttfts, 0.5):>10,.0f}"
                  f"{percentile(ttfts, 0.99):>10,.0f}"
                  f"{len(r.replies) / r.wall_s if r.wall_s else 0.0:>8.2f}"
                  f"{_fraction(cached):>8}{_fraction(own):>12}{_fraction(redis):>8}\n")
    if len(results) > 1:
        first = results[0].answers()
        same = all(r.answers() == first for r in results[1:])
        out.write(f"\nanswers equal under every policy: {'yes' if same else 'NO'}\n")
    out.write("\nTTFT in ms, client side through SMG. cached: cached / prompt tokens. own memory "
              "and Redis: of the cached tokens, the share a replica served from its device and "
              "host tiers, and from Redis (kvgate's usage.kvgate.cached_tokens_by_tier).\n")


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"
