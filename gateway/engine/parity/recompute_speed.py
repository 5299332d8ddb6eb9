"""The engine's recompute speed, measured once before it serves: the other half of the cache's
load-or-recompute judgement at a replica's first hit.

Why: the cache loads from disk or Redis only where that is no slower than recomputing
(``tiers.hierarchy``, ``worth_loading``), the recompute side from the engine's own prefill steps
(``gateway.engine.parity.prefill_speed``). Before its first prefill a replica had no figure and
loaded whatever the tier's speed, so a fresh replica whose first request found its prefix in a slow
Redis waited for the whole chain. Two prefill steps of random tokens, timed after a warm-up step
(kernels compiled, buffers grown: a remembered route skipped the start-up probe), give the
figure ``PrefillSpeed`` fits, and the engine's own steps refine it from the first request on.

The sizes: one block, and a full prefill step where that costs at most ``MAX_STEP_S`` at the
small step's rate, run once untimed first (on a GPU a small step is mostly fixed cost, so only
a large one shows the slope); elsewhere two blocks (on a CPU every token costs the same
matmuls, so a small step already shows it, and a 1,024-token step of SmolLM2 would add seconds
to every start).
"""

from __future__ import annotations

import logging
import time

import torch

from gateway.engine.forward.batched import SequenceRows, StepForward
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.parity.prefill_speed import PrefillSpeed
from tiers.page_pool import PagePool, PoolExhausted

logger = logging.getLogger(__name__)

MAX_STEP_S = 1.0
"""The longest the large measured step may be expected to take."""


def measure_recompute_speed(forward: StepForward, pool: PagePool, vocab_size: int, *,
                            block_tokens: int, step_tokens: int, speed: PrefillSpeed,
                            max_step_s: float = MAX_STEP_S,
                            seed: int = 0) -> list[tuple[int, float]]:
    """Time prefill steps of ``forward`` into ``speed``; returns the (tokens, seconds) recorded
    ([] where the pool had no room: the first requests' steps measure it instead)."""
    generator = torch.Generator().manual_seed(seed)

    def timed(num_tokens: int) -> float:
        seq = KVSequence(pool, num_tokens)
        tokens = torch.randint(0, vocab_size, (num_tokens,), generator=generator)
        try:
            _synchronize(pool.device)
            began = time.perf_counter()
            forward.forward([SequenceRows(sequence=seq, tokens=tokens, wants_logits=True)])
            _synchronize(pool.device)
            return time.perf_counter() - began
        finally:
            seq.release()

    try:
        timed(block_tokens)  # warm-up
        small = timed(block_tokens)
        if small * step_tokens / block_tokens <= max_step_s:
            large_tokens = step_tokens
            timed(large_tokens)  # a first step this large grows the activations' buffers
        else:
            large_tokens = 2 * block_tokens
        samples = [(block_tokens, small), (large_tokens, timed(large_tokens))]
    except PoolExhausted:
        logger.info("recompute speed not measured before serving: the pool had no room for "
                    "its steps; the first requests' steps measure it")
        return []
    for num_tokens, seconds in samples:
        speed.record(num_tokens, seconds)
    return samples


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
