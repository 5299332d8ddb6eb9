"""``kvgate bench fairness --lanes``: priority lanes inside one tenant (issue 28, item 2).

One app backend (one tenant, one key) serves two kinds of traffic: bulk users with long prompts
and interactive users with short chats. Across tenants the scheduler's fair share already keeps
a quiet tenant's first token near its time alone (``kvgate bench fairness``); inside one tenant
only ``priority`` can (``gateway.engine.scheduling.scheduler``, docs/design.md "Priority lanes").
The target: the interactive TTFT p99 under the bulk flood at most 1.5x its p99 alone, the bulk still
finishing. Three phases on one engine and cache, in process (no network: what is measured is
the scheduler, the preemptions and the step loop):

1. *alone*: the interactive users (2) send ``--requests`` short chats in all (each a new
   question: nothing is cached), one after the other each, at priority 0; TTFT of each from
   submission to its first token;
2. *one lane*: ``--flood`` bulk users each keep one long request in flight (fresh ~
   ``--flood-tokens``-word prompts, 64 answer tokens, a new one as soon as one ends), all at
   priority 0; once they fill the tenant's running slots (and ``WARM_UP_S`` more), the
   interactive users send new chats as in 1;
3. *two lanes*: the same with the bulk at priority 10: an interactive chat that finds its
   tenant's slots (or share) full preempts the latest bulk request, which resumes later from the
   K/V it handed to the cache.

It prints TTFT p50/p99 of each phase, the p99 ratios to *alone*, and what the bulk generated
(tokens, requests finished) and how often it was preempted while the interactive chats ran.
Side by side in one process: a slow machine slows every phase alike (the absolute figures are
not the point).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

from gateway.bench.chat_workload import system_prompt
from gateway.bench.fairness import FairnessOptions, question
from gateway.bench.load import percentile
from gateway.cache.operations.factory import CacheConfig, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.errors import RequestCancelled
from gateway.core.fingerprint import Scope
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, TokenDelta
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.kv.sequence import pool_bytes_for
from gateway.engine.models.loading import load_model

BACKEND = Scope.of_tenant("backend")
INTERACTIVE_USERS = 2
BULK_PRIORITY = 10
WARM_UP_S = 2.0
CATCH_UP_S = 900.0
"""How long a flooded phase waits, after its chats, for every bulk user to finish a request."""
SECRET = b"kvgate-bench-lanes-secret-000000"


LanesOptions = FairnessOptions
"""What ``kvgate bench fairness --lanes`` runs: the fairness bench's options (the same users,
flood and answer lengths; here the flood is the interactive users' own tenant)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LanesPhase:
    """One phase: the interactive TTFTs (seconds), and while they ran the bulk's tokens and
    finished requests and the preemptions."""

    name: str
    ttfts: list[float]
    bulk_tokens: int = 0
    bulk_finished: int = 0
    preemptions: int = 0
    bulk_catch_up_s: float | None = None
    """After the chats, the seconds until every bulk user had finished a request begun
    before they ended (None: alone, or not within ``CATCH_UP_S``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LanesResult:
    alone: LanesPhase
    one_lane: LanesPhase
    two_lanes: LanesPhase

    @property
    def phases(self) -> list[LanesPhase]:
        return [self.alone, self.one_lane, self.two_lanes]

    def p99_ratio(self, phase: LanesPhase) -> float:
        """``phase``'s interactive TTFT p99 over its p99 alone."""
        return percentile(phase.ttfts, 0.99) / percentile(self.alone.ttfts, 0.99)


def run_lanes_benchmark(options: LanesOptions, *, out: TextIO) -> LanesResult:
    """Run the three phases on one engine and print the table."""
    loaded = load_model(options.model, cache_dir=options.cache_dir)
    config = EngineConfig()
    opened = open_cache(CacheConfig(block_tokens=config.block_tokens, device_bytes=512 << 20,
                                    host_bytes=1 << 30, disk_bytes=0),
                        layout=loaded.layout, deployment_secret=SECRET,
                        running_bytes=pool_bytes_for(config.kv_budget_bytes
                                                     + config.tail_cache_bytes))
    engine = Engine(loaded=loaded, cache=opened.cache, pool=opened.pool, config=config,
                    deployment_secret=SECRET)
    try:
        engine.start()
        out.write(f"[lanes] engine route {engine.route.name}: {engine.route.reason}\n")
        out.flush()
        system = system_prompt(20)
        questions = iter(range(1_000_000))
        slots = min(options.flood, config.max_running_per_tenant)
        alone = LanesPhase(name="alone", ttfts=_interactive(engine, options, system, questions))
        out.write(f"[lanes] alone: {len(alone.ttfts)} requests done\n")
        out.flush()
        one_lane = _flooded(engine, options, system, questions, name="one lane",
                            bulk_priority=0, seeds=range(options.flood), slots=slots)
        out.write(f"[lanes] one lane: {len(one_lane.ttfts)} requests done\n")
        out.flush()
        two_lanes = _flooded(engine, options, system, questions, name="two lanes",
                             bulk_priority=BULK_PRIORITY,
                             seeds=range(options.flood, 2 * options.flood), slots=slots)
    finally:
        engine.stop(grace_s=1.0)
        opened.close()
    result = LanesResult(alone=alone, one_lane=one_lane, two_lanes=two_lanes)
    _print(options, result, out)
    return result


def _flooded(engine: Engine, options: LanesOptions, system: str, questions: Iterator[int], *,
             name: str, bulk_priority: int, seeds: range, slots: int) -> LanesPhase:
    """The interactive chats while the bulk users (one per seed: fresh prompts in each phase,
    nothing the previous phase cached) flood the tenant at ``bulk_priority``, once they hold
    ``slots`` running slots."""
    stop = threading.Event()
    counts = _BulkCounts()
    bulk = [threading.Thread(target=_bulk_user,
                             args=(engine, options, seed, bulk_priority, stop, counts),
                             daemon=True) for seed in seeds]
    for thread in bulk:
        thread.start()
    deadline = time.monotonic() + 600
    while engine.num_running < slots and time.monotonic() < deadline:
        time.sleep(0.05)  # a large step in flight delays the admission of the rest
    time.sleep(WARM_UP_S)
    preempted = engine.counters.num_preemptions
    tokens, done = counts.tokens, counts.finished
    ttfts = _interactive(engine, options, system, questions)
    bulk_tokens, bulk_finished = counts.tokens - tokens, counts.finished - done
    num_preempted = engine.counters.num_preemptions - preempted
    # The bulk still finishing: each user's request in flight when the chats ended completes.
    chats_ended = time.monotonic()
    with counts.lock:
        before = dict(counts.by_seed)
    catch_up: float | None = None
    while time.monotonic() - chats_ended < CATCH_UP_S:
        with counts.lock:
            if all(counts.by_seed.get(seed, 0) > before.get(seed, 0) for seed in seeds):
                catch_up = time.monotonic() - chats_ended
                break
        time.sleep(0.05)
    phase = LanesPhase(name=name, ttfts=ttfts, bulk_tokens=bulk_tokens,
                       bulk_finished=bulk_finished, preemptions=num_preempted,
                       bulk_catch_up_s=catch_up)
    stop.set()
    for thread in bulk:
        thread.join(timeout=600)
    return phase


@dataclass(slots=True)
class _BulkCounts:
    """What the bulk users have received (each thread adds under the lock)."""

    tokens: int = 0
    finished: int = 0
    by_seed: dict[int, int] = field(default_factory=dict)  # requests finished by each user
    lock: threading.Lock = field(default_factory=threading.Lock)


def _interactive(engine: Engine, options: LanesOptions, system: str,
                 questions: Iterator[int]) -> list[float]:
    """TTFTs of ``options.requests`` chats sent by ``INTERACTIVE_USERS`` users at once, each
    one chat after the other; in the order of the chats (user 1's first, user 2's first, ...)."""
    numbers = [next(questions) for _ in range(options.requests)]
    by_number: dict[int, float] = {}
    lock = threading.Lock()

    def user(mine: list[int]) -> None:
        for number in mine:
            seconds = _ttft(engine, question(system, number), options.max_tokens)
            with lock:
                by_number[number] = seconds

    users = [threading.Thread(target=user, args=(numbers[u::INTERACTIVE_USERS],), daemon=True)
             for u in range(INTERACTIVE_USERS)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join(timeout=1_800)
    return [by_number[number] for number in numbers if number in by_number]


def _ttft(engine: Engine, prompt: PromptInput, max_tokens: int) -> float:
    began = time.perf_counter()
    first: float | None = None
    handle = engine.generate(GenerateRequest(
        prompt=prompt, scope=BACKEND, sampling=SamplingParams(max_tokens=max_tokens),
        priority=0))
    for event in handle:
        if first is None and isinstance(event, TokenDelta):
            first = time.perf_counter() - began
    if first is None:
        raise RuntimeError("an interactive request produced no token")
    return first


def _bulk_user(engine: Engine, options: LanesOptions, seed: int, priority: int,
               stop: threading.Event, counts: _BulkCounts) -> None:
    rng = random.Random(seed)
    words = ["cache", "block", "tier", "prefix", "tenant", "token", "step", "queue", "model"]
    while not stop.is_set():
        text = " ".join(rng.choice(words) for _ in range(options.flood_tokens))
        handle = engine.generate(GenerateRequest(
            prompt=PromptInput(prompt=text), scope=BACKEND, priority=priority,
            sampling=SamplingParams(max_tokens=options.flood_max_tokens),
            cache=CacheOptions()))
        try:
            for event in handle:
                if stop.is_set():
                    handle.cancel()
                if isinstance(event, TokenDelta):
                    with counts.lock:
                        counts.tokens += len(event.token_ids)
        except RequestCancelled:
            return
        with counts.lock:
            counts.finished += 1
            counts.by_seed[seed] = counts.by_seed.get(seed, 0) + 1


def _print(options: LanesOptions, result: LanesResult, out: TextIO) -> None:
    out.write(f"\nkvgate bench fairness --lanes: one tenant; {INTERACTIVE_USERS} interactive "
              f"users send {options.requests} chats (a new 20-rule system prompt each, "
              f"{options.max_tokens} answer tokens) at priority 0, alone, then while "
              f"{options.flood} bulk users keep requests of "
              f"~{options.flood_tokens} prompt words and {options.flood_max_tokens} answer "
              f"tokens in flight at priority 0 (one lane) and at priority {BULK_PRIORITY} "
              f"(two lanes) ({options.model}, in process)\n\n")
    out.write(f"{'phase':<10} {'TTFT p50':>9} {'TTFT p99':>9} {'p99/alone':>10} "
              f"{'bulk tokens':>12} {'bulk done':>10} {'preempted':>10} {'bulk caught up':>15}\n")
    for phase in result.phases:
        caught = ("-" if phase.name == "alone" else "no" if phase.bulk_catch_up_s is None
                  else f"{phase.bulk_catch_up_s:,.1f} s")
        out.write(f"{phase.name:<10} {percentile(phase.ttfts, 0.5) * 1e3:>9,.0f} "
                  f"{percentile(phase.ttfts, 0.99) * 1e3:>9,.0f} "
                  f"{result.p99_ratio(phase):>9.2f}x {phase.bulk_tokens:>12} "
                  f"{phase.bulk_finished:>10} {phase.preemptions:>10} {caught:>15}\n")
    out.write("\nTTFT of each chat in ms (user 1's first, user 2's first, ...):\n")
    for phase in result.phases:
        out.write(f"{phase.name:<10} {' '.join(f'{t * 1e3:,.0f}' for t in phase.ttfts)}\n")
    two = result.two_lanes
    caught_up = ("every bulk user finished its request in flight "
                 f"{two.bulk_catch_up_s:,.1f} s after the chats" if two.bulk_catch_up_s
                 is not None else f"the bulk did NOT finish within {CATCH_UP_S:,.0f} s after "
                 "the chats")
    out.write(f"\nTTFT in ms, submission -> first token; the bulk's tokens, finished requests "
              f"and preemptions: while the interactive chats ran; bulk caught up: after them, "
              f"until every bulk user finished a request begun before. Target (issue 28): two "
              f"lanes p99 / alone <= 1.5x, the bulk still finishing; measured "
              f"{result.p99_ratio(two):.2f}x, the bulk generating {two.bulk_tokens} tokens and "
              f"finishing {two.bulk_finished} requests meanwhile; {caught_up}\n")
