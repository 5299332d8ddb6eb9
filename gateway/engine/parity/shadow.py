"""Shadow verification: a sampled cache hit recomputed cold, off the hot path, bit for bit.

Our first promise is warm == cold. The start-up probe checks the forward on a few fixed prompts;
this checks what the cache actually served, on the prompts clients actually send: a fraction
(``[engine] shadow_fraction``) of the requests that were served cached blocks is remembered
(namespace, tokens, the served blocks' keys, tiers and K/V), and when the step loop has nothing
to run it recomputes those blocks cold, one chunk per idle turn, and compares every layer's K and
V with ``torch.equal``. A block that differs is a fault somewhere below the promise (a flipped
bit in memory, a store that returns another block's bytes, a forward that stopped being
invariant): it is counted, logged with its key and the tier that served it, and evicted
everywhere (the callback given at construction: the cache admin's eviction by key, which reaches
Redis and the other replicas, and takes the block's chain: every block built on it and the
blocks before it that only it continues from), and the metric behind the
alert rule in ``deploy/observability/alerts.yaml`` goes up.

Why here, on the engine's worker thread: the forward is not thread-safe, and the worker is the
only thread that runs it. Why only when idle: a verification never delays a request by more than
the one chunk that was running when the request arrived; while the engine is never idle, samples
wait in a small bounded queue and the ones that do not fit are dropped and counted
(``num_dropped``), never computed on the hot path. That chunk is at most
``MAX_IDLE_CHUNK_TOKENS`` (a whole block at least), not a step: at ``shadow_fraction = 1.0`` a
step's 256 tokens of SmolLM2 on two CPU cores delayed another tenant's first token by ~1 s
(issue 44); a quarter of that chunk costs a quarter of that wait, and the recompute only more
idle turns (the batched forward is chunk-invariant, and every chunk still ends on a block).

NOTE: a sample keeps references to the served blocks, not copies: a tier hands out its payloads
read-only (``tiers.payload``), the device tier the very tensors it holds (a bit flipped in them
after serving is still what the cache would serve next, and is caught), and every other tier a
fresh copy. The queue bound (``max_pending``) bounds what this keeps alive.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from gateway.core.errors import GatewayError
from gateway.core.fingerprint import Namespace
from gateway.core.tokens import TokenIds
from gateway.engine.forward.batched import SequenceRows, StepForward
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.output.observer import EngineMetrics
from policies.base import BlockKey
from tiers.page_pool import PagePool
from tiers.payload import KVBlock

logger = logging.getLogger(__name__)

MAX_PENDING = 4
"""Samples waiting for idle capacity; more are dropped (counted)."""

MAX_IDLE_CHUNK_TOKENS = 64
"""Tokens one idle turn recomputes at most (rounded down to whole blocks, one block at least):
what a request arriving meanwhile waits for, whatever ``chunk_tokens`` the engine offers."""

EvictBlocks = Callable[[Sequence[BlockKey]], None]
"""Evicts blocks (with their chains: ``gateway.cache.operations.admin.chain_of``) by key,
everywhere the deployment keeps them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ShadowSample:
    """One cache hit to verify: the first ``len(keys)`` full blocks of ``tokens``, as served.

    Attributes:
        namespace: where the blocks were read (the request's, or the shared scope's).
        tokens: the tokens of the served blocks (``len(keys) * block_tokens`` of them).
        keys: the served blocks' keys, in prompt order.
        tiers: the tier each was served from.
        blocks: the served K/V (references, see the module's NOTE).
    """

    namespace: Namespace
    tokens: TokenIds
    keys: tuple[BlockKey, ...]
    tiers: tuple[str, ...]
    blocks: tuple[KVBlock, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShadowCounters:
    """What shadow verification has done since start.

    Attributes:
        num_offered: cache hits the verifier was shown.
        num_sampled: of them, kept for verification.
        num_dropped: sampled but dropped (the queue was full: the engine was never idle).
        num_checked: verified to the end.
        num_blocks_checked: blocks compared.
        num_divergent_checks: verifications that found at least one block differing from cold.
        num_divergent_blocks: blocks that differed (each was evicted).
        num_failed: verifications that raised (logged; the sample is dropped).
    """

    num_offered: int = 0
    num_sampled: int = 0
    num_dropped: int = 0
    num_checked: int = 0
    num_blocks_checked: int = 0
    num_divergent_checks: int = 0
    num_divergent_blocks: int = 0
    num_failed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    """One served block that differs from its cold recompute."""

    index: int
    key: BlockKey
    tier: str
    where: str  # e.g. "layer 3 V"


class _Running:
    """The sample being recomputed, and how far."""

    __slots__ = ("sample", "seq", "ids")

    def __init__(self, sample: ShadowSample, seq: KVSequence, ids: torch.Tensor) -> None:
        self.sample = sample
        self.seq = seq
        self.ids = ids


class ShadowVerifier:
    """Samples cache hits and verifies them cold when the step loop is idle.

    ``offer`` runs on the hot path (a random draw, and an append for a sampled hit); ``advance``
    runs one chunk of recomputation, on the worker thread, only when nothing else is to run.

    Args:
        fraction: the fraction of cache hits verified, in [0, 1] (0: none).
        forward: the engine's forward (the one that computed the served blocks).
        pool: where the cold recompute's pages come from (the engine's pool).
        block_tokens: tokens per block.
        chunk_tokens: tokens one idle turn recomputes at most (a multiple of ``block_tokens``;
            ``block_tokens`` on the serial route, whose oracle is block-aligned); lowered to
            ``MAX_IDLE_CHUNK_TOKENS`` in whole blocks where it is more.
        evict: evicts divergent blocks by key, everywhere.
        metrics: where checks and divergences are recorded (None: nowhere).
        seed: seeds the sampling (reproducible runs and tests).
        max_pending: samples waiting for idle capacity at most.
    """

    def __init__(self, *, fraction: float, forward: StepForward, pool: PagePool,
                 block_tokens: int, chunk_tokens: int, evict: EvictBlocks,
                 metrics: EngineMetrics | None = None, seed: int = 0,
                 max_pending: int = MAX_PENDING) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        if chunk_tokens < block_tokens or chunk_tokens % block_tokens:
            raise ValueError(f"chunk_tokens ({chunk_tokens}) must be a multiple of "
                             f"block_tokens ({block_tokens})")
        self._fraction = fraction
        self._forward = forward
        self._pool = pool
        self._block_tokens = block_tokens
        self._chunk_tokens = min(chunk_tokens,
                                 max(block_tokens, MAX_IDLE_CHUNK_TOKENS // block_tokens
                                     * block_tokens))
        self._evict = evict
        self._metrics = metrics
        self._rng = random.Random(seed)
        self._pending: deque[ShadowSample] = deque()
        self._max_pending = max_pending
        self._running: _Running | None = None
        self._counters = ShadowCounters()

    @property
    def counters(self) -> ShadowCounters:
        return self._counters

    @property
    def has_work(self) -> bool:
        """Whether a sample waits for (or is in) its recomputation."""
        return self._running is not None or bool(self._pending)

    def offer(self, *, namespace: Namespace, tokens: TokenIds, keys: Sequence[BlockKey],
              tiers: Sequence[str], blocks: Sequence[KVBlock]) -> bool:
        """A request was served ``blocks`` (keys ``keys``, from ``tiers``): keep it for
        verification with probability ``fraction``; whether it was kept."""
        if self._fraction <= 0.0 or not blocks:
            return False
        counters = self._counters
        is_sampled = self._fraction >= 1.0 or self._rng.random() < self._fraction
        if not is_sampled:
            self._counters = replace(counters, num_offered=counters.num_offered + 1)
            return False
        if len(self._pending) >= self._max_pending:
            self._counters = replace(counters, num_offered=counters.num_offered + 1,
                                     num_sampled=counters.num_sampled + 1,
                                     num_dropped=counters.num_dropped + 1)
            return False
        n = len(blocks)
        self._pending.append(ShadowSample(
            namespace=namespace, tokens=tokens[:n * self._block_tokens], keys=tuple(keys[:n]),
            tiers=tuple(tiers[:n]), blocks=tuple(blocks)))
        self._counters = replace(counters, num_offered=counters.num_offered + 1,
                                 num_sampled=counters.num_sampled + 1)
        return True

    def advance(self) -> list[Divergence] | None:
        """Recompute one chunk of the current sample (starting the next if none runs); at the
        end of a sample, compare and act. Call only from the worker thread, only when idle.

        Returns:
            The sample's divergences ([] if none) when one was finished, else None.
        """
        try:
            running = self._running
            if running is None:
                if not self._pending:
                    return None
                running = self._running = self._start(self._pending.popleft())
            start = running.seq.length
            end = min(start + self._chunk_tokens, len(running.ids))
            self._forward.forward([SequenceRows(sequence=running.seq,
                                                tokens=running.ids[start:end],
                                                wants_logits=False)])
            if running.seq.length < len(running.ids):
                return None
            self._running = None
            divergences = self._compare(running)
            running.seq.release()
        except Exception:  # a verification never takes the engine down
            # NOTE: logged with its traceback and counted; the request it sampled was served
            # already, and the next sample starts afresh (an out-of-memory here frees it).
            logger.exception("shadow verification failed; the sample is dropped")
            if self._running is not None:
                self._running.seq.release()
            self._running = None
            c = self._counters
            self._counters = replace(c, num_failed=c.num_failed + 1)
            return None
        self._conclude(running.sample, divergences)
        return divergences

    def _start(self, sample: ShadowSample) -> _Running:
        ids = torch.from_numpy(np.asarray(sample.tokens).astype(np.int64))
        seq = KVSequence(self._pool, len(ids))
        return _Running(sample, seq, ids)

    def _compare(self, running: _Running) -> list[Divergence]:
        sample, bt = running.sample, self._block_tokens
        divergences = []
        for i, served in enumerate(sample.blocks):
            cold = running.seq.block(i, bt)
            where = _first_difference(served, cold)
            if where is not None:
                divergences.append(Divergence(index=i, key=sample.keys[i],
                                              tier=sample.tiers[i], where=where))
        return divergences

    def _conclude(self, sample: ShadowSample, divergences: list[Divergence]) -> None:
        c = self._counters
        self._counters = replace(
            c, num_checked=c.num_checked + 1,
            num_blocks_checked=c.num_blocks_checked + len(sample.blocks),
            num_divergent_checks=c.num_divergent_checks + (1 if divergences else 0),
            num_divergent_blocks=c.num_divergent_blocks + len(divergences))
        if self._metrics is not None:
            self._metrics.record_shadow_check(
                num_blocks=len(sample.blocks), divergent_tiers=[d.tier for d in divergences])
        if not divergences:
            return
        logger.error(
            "shadow verification: %d of %d served blocks differ from their cold recompute "
            "(warm != cold); evicting them everywhere: %s", len(divergences), len(sample.blocks),
            ", ".join(f"block {d.index} key {d.key.hex()} from tier {d.tier} ({d.where})"
                      for d in divergences))
        try:
            self._evict([d.key for d in divergences])
        except GatewayError as exc:  # e.g. evicted here and in Redis, other replicas not told
            logger.error("shadow verification: evicting the divergent blocks did not reach "
                         "everywhere: %s", exc)


def _first_difference(served: KVBlock, cold: KVBlock) -> str | None:
    """Where ``served`` first differs from ``cold`` ("layer 3 V"), or None if bit for bit
    equal (same dtype and shape too)."""
    for layer in range(max(served.num_layers, cold.num_layers)):
        for kind, parts, cold_parts in (("K", served.keys, cold.keys),
                                        ("V", served.values, cold.values)):
            if layer >= len(parts) or layer >= len(cold_parts):
                return f"layer {layer} {kind} missing"
            a, b = parts[layer], cold_parts[layer]
            if a.dtype != b.dtype or a.shape != b.shape:
                return f"layer {layer} {kind} shape/dtype"
            if not torch.equal(a.to(b.device), b):
                return f"layer {layer} {kind}"
    return None
