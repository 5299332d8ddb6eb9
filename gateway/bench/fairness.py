"""``kvgate bench fairness``: one tenant's first-token time while another tenant floods.

The engine schedules tenants by deficit (``gateway.engine.scheduling.scheduler``), so a tenant that
sends a few short requests should see its first token about as soon as when it runs alone, however
many
long requests another tenant keeps queued. This measures it on the real engine and model, in
process (no network: what is measured is the scheduler and the step loop, not gRPC):

1. *alone*: tenant "quiet" sends ``--requests`` short chat requests one after the other (each a
   new question, so nothing is cached); TTFT of each from submission to its first token;
2. *flooded*: tenant "flood" keeps ``--flood`` long requests in flight (fresh ~``--flood-tokens``
   token prompts, ``no_cache``, ``--flood-max-tokens`` each, a new one as soon as one ends), and
   tenant "quiet" sends the same requests again.

It prints TTFT p50/p99 of both phases and the ratios flooded/alone, the bound (issue 22) being
2x on p50. One run of one process: the ratio is measured side by side, so a slow machine slows
both phases alike (the absolute figures are not the point).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gateway.bench.chat_workload import system_prompt
from gateway.bench.load import percentile
from gateway.core.canonical import PromptInput
from gateway.core.errors import RequestCancelled
from gateway.core.fingerprint import Scope
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, TokenDelta
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.models.loading import load_model

QUIET = Scope.of_tenant("quiet")
FLOOD = Scope.of_tenant("flood")


@dataclass(frozen=True, slots=True, kw_only=True)
class FairnessOptions:
    """What ``kvgate bench fairness`` runs."""

    model: str
    cache_dir: Path
    requests: int = 12
    flood: int = 8
    flood_tokens: int = 1024
    flood_max_tokens: int = 64
    max_tokens: int = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class FairnessResult:
    """The quiet tenant's TTFTs (seconds) alone and under the flood."""

    alone: list[float]
    flooded: list[float]
    flood_requests_finished: int

    @property
    def p50_ratio(self) -> float:
        return percentile(self.flooded, 0.5) / percentile(self.alone, 0.5)

    @property
    def p99_ratio(self) -> float:
        return percentile(self.flooded, 0.99) / percentile(self.alone, 0.99)


def run_fairness_benchmark(options: FairnessOptions, *, out: TextIO) -> FairnessResult:
    """Run both phases on one engine and print the table."""
    loaded = load_model(options.model, cache_dir=options.cache_dir)
    engine = Engine(loaded=loaded, cache=None, config=EngineConfig(),
                    deployment_secret=b"kvgate-bench-fairness-secret-000")
    engine.start()
    out.write(f"[fairness] engine route {engine.route.name}: {engine.route.reason}\n")
    out.flush()
    try:
        system = system_prompt(20)
        alone = [_ttft(engine, question(system, i), options.max_tokens)
                 for i in range(options.requests)]
        out.write(f"[fairness] alone: {len(alone)} requests done\n")
        out.flush()
        stop = threading.Event()
        finished = [0]
        flooders = [threading.Thread(target=_flood, args=(engine, options, seed, stop, finished),
                                     daemon=True) for seed in range(options.flood)]
        for thread in flooders:
            thread.start()
        time.sleep(2.0)  # let the flood fill the running set and the queue
        flooded = [_ttft(engine, question(system, options.requests + i), options.max_tokens)
                   for i in range(options.requests)]
        stop.set()
        for thread in flooders:
            thread.join(timeout=600)
    finally:
        engine.stop(grace_s=1.0)
    result = FairnessResult(alone=alone, flooded=flooded, flood_requests_finished=finished[0])
    _print(options, result, out)
    return result


def question(system: str, index: int) -> PromptInput:
    """Chat ``index``: a new session under ``system``, asking about one of its rules (a prompt
    nothing before it cached)."""
    return PromptInput(messages=[
        {"role": "system", "content": f"Session {index}. {system}"},
        {"role": "user", "content": f"In one sentence: what does rule {index % 20 + 1} say?"}])


def _ttft(engine: Engine, prompt: PromptInput, max_tokens: int) -> float:
    began = time.perf_counter()
    first: float | None = None
    handle = engine.generate(GenerateRequest(
        prompt=prompt, scope=QUIET, sampling=SamplingParams(max_tokens=max_tokens),
        cache=CacheOptions(no_cache=True)))
    for event in handle:
        if first is None and isinstance(event, TokenDelta):
            first = time.perf_counter() - began
    if first is None:
        raise RuntimeError("the quiet tenant's request produced no token")
    return first


def _flood(engine: Engine, options: FairnessOptions, seed: int, stop: threading.Event,
           finished: list[int]) -> None:
    rng = random.Random(seed)
    words = ["cache", "block", "tier", "prefix", "tenant", "token", "step", "queue", "model"]
    while not stop.is_set():
        text = " ".join(rng.choice(words) for _ in range(options.flood_tokens))
        handle = engine.generate(GenerateRequest(
            prompt=PromptInput(prompt=text), scope=FLOOD,
            sampling=SamplingParams(max_tokens=options.flood_max_tokens),
            cache=CacheOptions(no_cache=True)))
        try:
            for _ in handle:
                if stop.is_set():
                    handle.cancel()
        except RequestCancelled:
            return
        finished[0] += 1


def _print(options: FairnessOptions, result: FairnessResult, out: TextIO) -> None:
    out.write(f"\nkvgate bench fairness: tenant 'quiet' sends {options.requests} short requests "
              f"({options.max_tokens} tokens) alone, then while tenant 'flood' keeps "
              f"{options.flood} requests of ~{options.flood_tokens} prompt tokens and "
              f"{options.flood_max_tokens} answer tokens in flight ({options.model}, in process)"
              f"\n\n")
    out.write(f"{'phase':<10} {'TTFT p50':>9} {'TTFT p99':>9}\n")
    for name, values in (("alone", result.alone), ("flooded", result.flooded)):
        out.write(f"{name:<10} {percentile(values, 0.5) * 1e3:>9,.0f} "
                  f"{percentile(values, 0.99) * 1e3:>9,.0f}\n")
    out.write(f"\nTTFT in ms, submission -> first token. flooded / alone: p50 "
              f"{result.p50_ratio:.2f}x (bound: 2x), p99 {result.p99_ratio:.2f}x; flood requests "
              f"finished meanwhile: {result.flood_requests_finished}\n")
