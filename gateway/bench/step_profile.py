"""``kvgate bench profile``: where the engine's time goes under the chat load (issue 45, item 1).

The chat load of ``kvgate bench load`` (users under one system prompt, rounds of short
questions, greedy answers) runs in process against one engine with device and host tiers, at
each ``--users`` count in turn, each count under a system prompt of its own (so that every
count starts cold, as a fresh server would). Meanwhile ``gateway.bench.stack_sampler`` samples
the engine's worker thread every millisecond and files each sample under a part of the step
loop (the products, the attention, sampling, detokenising, the cache's work, waiting...), and
the process's CPU time over the wall time says how many cores were busy.

In process means no gRPC or HTTP: what is profiled is the engine's own thread, which every
request's tokens pass through; the fronts' streaming is not in these figures.
"""

from __future__ import annotations

import resource
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gateway.bench.chat_workload import system_prompt
from gateway.bench.load import percentile
from gateway.bench.load_clients import run_users
from gateway.bench.peer_serve import StreamedReply
from gateway.bench.rows import BenchError
from gateway.bench.stack_sampler import StackSampler, shares
from gateway.cache.operations.factory import CacheConfig, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.requests import GenerateRequest, SamplingParams, TokenDelta, Usage
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.kv.sequence import pool_bytes_for
from gateway.engine.models.loading import load_model

SECRET = b"kvgate-bench-profile-secret-0000"
ENGINE_THREAD = "kvgate-engine"
"""The name of the engine's worker thread (``Engine.start``): the thread sampled."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileOptions:
    """What ``kvgate bench profile`` runs."""

    model: str
    cache_dir: Path
    users: Sequence[int] = (1, 8)
    rounds: int = 4
    max_tokens: int = 32
    rules: int = 60


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadProfile:
    """One users count's run: its samples by part, its wall and CPU seconds, its replies."""

    users: int
    parts: Counter[str]
    wall_s: float
    cpu_s: float
    replies: int
    completion_tokens: int
    ttft_p50_s: float

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class EngineSession:
    """One user's chat straight into the engine (``load_clients.ChatSession``)."""

    def __init__(self, engine: Engine, *, max_tokens: int) -> None:
        self._engine = engine
        self._max_tokens = max_tokens

    def chat(self, messages: Sequence[dict[str, str]]) -> StreamedReply:
        began = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        usage: Usage | None = None
        handle = self._engine.generate(GenerateRequest(
            prompt=PromptInput(messages=list(messages)), scope=Scope.of_tenant("bench"),
            sampling=SamplingParams(max_tokens=self._max_tokens)))
        for event in handle:
            if isinstance(event, TokenDelta):
                if first is None:
                    first = time.perf_counter() - began
                parts.append(event.text)
            elif isinstance(event, Usage):
                usage = event
        if first is None or usage is None:
            raise BenchError("the engine's answer ended without a token or without usage")
        return StreamedReply(text="".join(parts), ttft_s=first,
                             latency_s=time.perf_counter() - began,
                             prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                             completion_tokens=usage.completion_tokens)

    def close(self) -> None:
        return None


def run_profile_benchmark(options: ProfileOptions, *, out: TextIO) -> list[LoadProfile]:
    """Run the chat load at each users count on one engine, sampled; print the table."""
    loaded = load_model(options.model, cache_dir=options.cache_dir)
    config = EngineConfig()
    opened = open_cache(CacheConfig(block_tokens=config.block_tokens, device_bytes=512 << 20,
                                    host_bytes=1 << 30, disk_bytes=0),
                        layout=loaded.layout, deployment_secret=SECRET,
                        running_bytes=pool_bytes_for(config.kv_budget_bytes
                                                     + config.tail_cache_bytes))
    engine = Engine(loaded=loaded, cache=opened.cache, pool=opened.pool, config=config,
                    deployment_secret=SECRET)
    profiles = []
    try:
        engine.start()
        out.write(f"[profile] engine route {engine.route.name}: {engine.route.reason}\n")
        out.flush()
        worker = next(t for t in threading.enumerate() if t.name == ENGINE_THREAD)
        assert worker.ident is not None
        for users in options.users:
            profiles.append(_profile(engine, worker.ident, users, options))
            out.write(f"[profile] {users} users: done\n")
            out.flush()
    finally:
        engine.stop(grace_s=1.0)
        opened.close()
    _print(options, profiles, out)
    return profiles


def _profile(engine: Engine, thread_id: int, users: int,
             options: ProfileOptions) -> LoadProfile:
    system = f"Load of {users} users. " + system_prompt(options.rules)
    sampler = StackSampler(thread_id).start()
    cpu_before = _cpu_s()
    began = time.perf_counter()
    replies, _ = run_users(lambda: EngineSession(engine, max_tokens=options.max_tokens),
                           num_users=users, rounds=options.rounds, system=system,
                           num_rules=options.rules)
    wall = time.perf_counter() - began
    cpu = _cpu_s() - cpu_before
    parts = sampler.stop()
    return LoadProfile(users=users, parts=parts, wall_s=wall, cpu_s=cpu, replies=len(replies),
                       completion_tokens=sum(r.completion_tokens for r in replies),
                       ttft_p50_s=percentile([r.ttft_s for r in replies], 0.5))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _print(options: ProfileOptions, profiles: list[LoadProfile], out: TextIO) -> None:
    out.write(f"\nkvgate bench profile: the chat load ({options.rounds} rounds x "
              f"{options.max_tokens} greedy tokens under a {options.rules}-rule system prompt) "
              f"in process, the engine's worker thread sampled every 1 ms ({options.model})\n\n")
    names = sorted({part for p in profiles for part in p.parts},
                   key=lambda part: -sum(p.parts[part] for p in profiles))
    header = f"{'share of the engine thread':<44}" + "".join(
        f"{f'{p.users} users':>10}" for p in profiles)
    out.write(header + "\n")
    for name in names:
        row = [dict(shares(p.parts)).get(name, 0.0) for p in profiles]
        out.write(f"{name:<44}" + "".join(f"{share:>10.1%}" for share in row) + "\n")
    out.write(f"{'cores busy (process CPU s / wall s)':<44}"
              + "".join(f"{p.cores:>10.2f}" for p in profiles) + "\n")
    out.write(f"{'tokens generated / s':<44}"
              + "".join(f"{p.completion_tokens / p.wall_s:>10.1f}" for p in profiles) + "\n")
    out.write(f"{'TTFT p50 ms (in process)':<44}"
              + "".join(f"{p.ttft_p50_s * 1e3:>10,.0f}" for p in profiles) + "\n")
    out.write(f"{'wall s':<44}" + "".join(f"{p.wall_s:>10.1f}" for p in profiles) + "\n")
