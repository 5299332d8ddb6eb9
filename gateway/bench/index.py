"""``kvgate bench index``: fingerprint, longest-prefix lookup, insert, eviction and memory.

Figures are printed, never asserted: this machine is shared and noisy, so the benchmark
reports medians and p99s of many repeats side by side in one run.

The synthetic workload looks like a gateway's: ``NUM_SYSTEM_PROMPTS`` system prompts of 8 blocks
(2,048 tokens at 256 tokens a block), each continued by many conversations of 8 unique blocks.
Queries are a 512-token prompt (2 blocks, all cached), a 2,048-token prompt (a whole system
prompt, cached) and an 8,192-token prompt (system prompt + a cached conversation + 16 new
blocks), so lookups walk both hits and misses.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TextIO

import numpy as np

from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.cache.radix_index import BlockSpec, RadixIndex
from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
from gateway.core.tokens import TokenIds, as_token_ids
from policies.base import BlockKey
from policies.registry import TierPolicyConfig, build_tier_policy

NUM_SYSTEM_PROMPTS = 64
BLOCKS_PER_SYSTEM_PROMPT = 8
BLOCKS_PER_CONVERSATION = 8
BLOCK_PAYLOAD_BYTES = 1 << 20  # nominal; only the policy's arithmetic sees it


@dataclass(frozen=True, slots=True, kw_only=True)
class SizeFigures:
    num_blocks: int
    fingerprint_us: dict[int, float]
    lookup_p50_us: dict[int, float]
    lookup_p99_us: dict[int, float]
    insert_blocks_per_s: float
    evict_blocks_per_s: float
    index_bytes_per_block: float
    cache_bytes_per_block: float


class _Workload:
    """Deterministic token streams for system prompts and conversations."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        self.block_tokens = block_tokens
        self._rng = np.random.default_rng(seed)
        self.system_prompts = [self._tokens(BLOCKS_PER_SYSTEM_PROMPT)
                               for _ in range(NUM_SYSTEM_PROMPTS)]

    def _tokens(self, num_blocks: int) -> TokenIds:
        return as_token_ids(
            self._rng.integers(0, 49_152, size=num_blocks * self.block_tokens, dtype=np.uint32)
        )

    def conversation(self, i: int) -> TokenIds:
        system = self.system_prompts[i % NUM_SYSTEM_PROMPTS]
        return as_token_ids(np.concatenate([system, self._tokens(BLOCKS_PER_CONVERSATION)]))

    def fresh(self, num_blocks: int) -> TokenIds:
        return self._tokens(num_blocks)


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time_us(fn: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    clock = time.perf_counter_ns
    for _ in range(repeats):
        start = clock()
        fn()
        samples.append((clock() - start) / 1000)
    return samples


def _build_cache(num_blocks: int, workload: _Workload, block_tokens: int) -> tuple[
    PrefixCache, list[TokenIds], float
]:
    policy = build_tier_policy(
        TierPolicyConfig(order="lru", budget_bytes=(num_blocks * 2) * BLOCK_PAYLOAD_BYTES)
    )
    cache = PrefixCache(tiers=[TierSlot(name="device", policy=policy)], block_tokens=block_tokens)
    num_conversations = max(
        1, (num_blocks - NUM_SYSTEM_PROMPTS * BLOCKS_PER_SYSTEM_PROMPT) // BLOCKS_PER_CONVERSATION
    )
    conversations = []
    start = time.perf_counter()
    for i in range(num_conversations):
        tokens = workload.conversation(i)
        ns = _NAMESPACE
        with cache.acquire(ns, tokens) as lease:
            cache.insert(lease, tier="device", block_bytes=BLOCK_PAYLOAD_BYTES)
        if i < 256:
            conversations.append(tokens)
    elapsed = time.perf_counter() - start
    return cache, conversations, len_blocks(cache) / elapsed


def len_blocks(cache: PrefixCache) -> int:
    return cache.stats().num_blocks


def _index_bytes_per_block(num_blocks: int, block_tokens: int) -> float:
    """Python memory of the bare index per block, its token bytes excluded."""
    rng = np.random.default_rng(1)
    chain_len = BLOCKS_PER_CONVERSATION
    num_chains = max(1, num_blocks // chain_len)
    token_bytes = block_tokens * 4
    payload = rng.integers(0, 256, size=num_chains * chain_len * token_bytes, dtype=np.uint8)
    blob = payload.tobytes()
    del payload
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    index = RadixIndex()
    num_token_bytes = 0
    offset = 0
    for c in range(num_chains):
        specs = []
        for _ in range(chain_len):
            tokens = blob[offset : offset + token_bytes]
            offset += token_bytes
            key = BlockKey(os.urandom(16))
            specs.append(BlockSpec(key=key, tokens=tokens, num_bytes=BLOCK_PAYLOAD_BYTES))
            num_token_bytes += len(tokens) + 33  # bytes object header
        index.insert(_NAMESPACE, None, specs, now=float(c), ttl_s=None)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return (used - num_token_bytes) / len(index)


def _cache_bytes_per_block(num_blocks: int, workload: _Workload, block_tokens: int) -> float:
    """Index + one tier's LRU/TTL policy per block, token bytes excluded."""
    num_conversations = max(1, num_blocks // BLOCKS_PER_CONVERSATION)
    tokens = [workload.conversation(i) for i in range(num_conversations)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    policy = build_tier_policy(TierPolicyConfig(order="lru", budget_bytes=1 << 60))
    cache = PrefixCache(tiers=[TierSlot(name="device", policy=policy)], block_tokens=block_tokens)
    for t in tokens:
        with cache.acquire(_NAMESPACE, t) as lease:
            cache.insert(lease, tier="device", block_bytes=BLOCK_PAYLOAD_BYTES, ttl_s=300.0)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    num = len_blocks(cache)
    return (used - num * (block_tokens * 4 + 33)) / num


_NAMESPACE = derive_namespace(
    NamespaceSpec(
        deployment_secret=b"bench-secret-0123456789abcdef!!",
        model_fingerprint="bench-model",
        kv_dtype="float32",
        device_kind="cpu",
        scope=Scope.of_tenant("bench"),
    )
)


@dataclass(frozen=True, slots=True, kw_only=True)
class _SpeedFigures:
    fingerprint_us: dict[int, float]
    lookup_p50_us: dict[int, float]
    lookup_p99_us: dict[int, float]
    insert_blocks_per_s: float
    evict_blocks_per_s: float


def _measure_speed(
    num_blocks: int, workload: _Workload, *, block_tokens: int, repeats: int
) -> _SpeedFigures:
    cache, conversations, insert_rate = _build_cache(num_blocks, workload, block_tokens)
    fp = cache.fingerprinter(_NAMESPACE)
    system = workload.system_prompts[0]
    prompts = {
        512: as_token_ids(system[:512]),
        2048: system,
        8192: as_token_ids(np.concatenate([conversations[0], workload.fresh(16)])),
    }
    fingerprint_us: dict[int, float] = {}
    p50: dict[int, float] = {}
    p99: dict[int, float] = {}
    for length, tokens in prompts.items():
        fingerprint_us[length] = statistics.median(
            _time_us(partial(fp.block_keys, tokens), repeats)
        )
        samples = _time_us(partial(cache.lookup, _NAMESPACE, tokens), repeats)
        p50[length] = statistics.median(samples)
        p99[length] = _percentile(samples, 0.99)
    # Eviction: free a tenth of the blocks' bytes, leaves first.
    num_victims = max(1, len_blocks(cache) // 10)
    start = time.perf_counter()
    result = cache.evict("device", num_victims * BLOCK_PAYLOAD_BYTES)
    evict_rate = len(result.victims) / (time.perf_counter() - start)
    return _SpeedFigures(
        fingerprint_us=fingerprint_us,
        lookup_p50_us=p50,
        lookup_p99_us=p99,
        insert_blocks_per_s=insert_rate,
        evict_blocks_per_s=evict_rate,
    )


def measure_size(
    num_blocks: int, *, block_tokens: int, repeats: int, measure_memory: bool
) -> SizeFigures:
    """All figures for one index size (the speed run's cache is freed before memory runs)."""
    workload = _Workload(block_tokens)
    speed = _measure_speed(num_blocks, workload, block_tokens=block_tokens, repeats=repeats)
    gc.collect()
    nan = float("nan")
    return SizeFigures(
        num_blocks=num_blocks,
        fingerprint_us=speed.fingerprint_us,
        lookup_p50_us=speed.lookup_p50_us,
        lookup_p99_us=speed.lookup_p99_us,
        insert_blocks_per_s=speed.insert_blocks_per_s,
        evict_blocks_per_s=speed.evict_blocks_per_s,
        index_bytes_per_block=(
            _index_bytes_per_block(num_blocks, block_tokens) if measure_memory else nan
        ),
        cache_bytes_per_block=(
            _cache_bytes_per_block(num_blocks, workload, block_tokens) if measure_memory else nan
        ),
    )


def run_index_benchmark(*, sizes: list[int], block_tokens: int, repeats: int, out: TextIO,
                        measure_memory: bool = True) -> list[SizeFigures]:
    """Run every size and print one table; returns the figures."""
    out.write(
        f"kvgate bench index: block_tokens={block_tokens}, {repeats} repeats per figure, "
        f"{NUM_SYSTEM_PROMPTS} system prompts x conversations of "
        f"{BLOCKS_PER_CONVERSATION} blocks\n"
    )
    out.write(
        "fingerprint+lookup = PrefixCache.lookup (hash every full block, walk the trie, verify "
        "tokens)\n\n"
    )
    header = (
        f"{'blocks':>9} | {'fp 512':>7} {'fp 2k':>7} {'fp 8k':>7} | "
        f"{'lkp 512 p50/p99':>16} {'lkp 2k p50/p99':>16} {'lkp 8k p50/p99':>16} | "
        f"{'insert/s':>9} {'evict/s':>9} | {'idx B/blk':>9} {'+pol B/blk':>10}\n"
    )
    out.write(header)
    out.write("-" * (len(header) - 1) + "\n")
    figures = []
    for size in sizes:
        f = measure_size(size, block_tokens=block_tokens, repeats=repeats,
                         measure_memory=measure_memory)
        figures.append(f)
        out.write(
            f"{f.num_blocks:>9,} | "
            + " ".join(f"{f.fingerprint_us[n]:>5.1f}us" for n in (512, 2048, 8192))
            + " | "
            + " ".join(
                f"{f.lookup_p50_us[n]:>7.1f}/{f.lookup_p99_us[n]:>6.1f}us"
                for n in (512, 2048, 8192)
            )
            + f" | {f.insert_blocks_per_s:>9,.0f} {f.evict_blocks_per_s:>9,.0f}"
            + f" | {f.index_bytes_per_block:>9.0f} {f.cache_bytes_per_block:>10.0f}\n"
        )
        out.flush()
    out.write(
        "\nfp = fingerprint only (median); lkp = fingerprint + longest-prefix lookup; "
        "insert/s = blocks admitted through PrefixCache (acquire, hash, insert, LRU+TTL "
        "admission); evict/s = blocks evicted leaves-first; idx B/blk = bare radix index "
        "memory per block (tracemalloc), token ids excluded; +pol = with one tier's LRU+TTL "
        "policy and the prefix cache around it.\n"
    )
    return figures
