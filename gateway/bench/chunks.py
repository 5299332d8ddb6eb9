"""``kvgate bench chunks``: cold prefill time by chunk size, to choose ``step_tokens``.

With the invariant forward the cache block (``block_tokens``) and the prefill chunk (at most
``step_tokens`` per step) are independent: a block's K/V are the same however it was chunked.
This measures what a chunk size costs a cold prefill on the batched forward, beside the two
references: transformers' own one-shot prefill (the floor for a prompt computed at once) and the
serial route's block-aligned chunks through transformers (how kvgate prefilled before, and
still does where the start-up probe fails). Sizes are measured round-robin within each repeat,
so a noisy neighbour slows every size alike. Everything runs on ``--device`` in ``--dtype``
(``gateway.bench.numerics``), and each timing ends once the device is done.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

from gateway.bench.numerics import BenchNumerics, resolve_numerics
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import (
    LoadedModel,
    forward_logits,
    load_model,
    make_sequence_cache,
)
from gateway.engine.parity.route_search import SearchSettings, build_forward, search_route

SERIAL_CHUNK = 256


def run_chunks_benchmark(*, model: str, cache_dir: Path, sizes: list[int], prompt_tokens: int,
                         repeats: int, out: TextIO,
                         numerics: BenchNumerics | None = None) -> dict[str, float]:
    """Print and return the median cold prefill seconds of ``prompt_tokens`` per variant, on
    ``numerics`` (default: ``auto``, as ``kvgate serve`` resolves it)."""
    numerics = numerics or resolve_numerics()
    device = numerics.device
    loaded = load_model(model, cache_dir=cache_dir, device=device, dtype=numerics.dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.tokenizer.vocab_size, (prompt_tokens,),
                        generator=generator).to(device)
    verdict = search_route(loaded, SearchSettings())
    forward = build_forward(loaded, verdict)
    if not isinstance(forward, BatchedForward):
        raise SystemExit(f"the batched forward is not invariant here: {verdict.reason}")
    variants: dict[str, Callable[[], None]] = {
        f"batched, chunks of {size}": _batched(loaded, forward, ids, size, device)
        for size in sizes}
    variants["transformers, one shot"] = lambda: _one_shot(loaded, ids)
    variants[f"serial route, {SERIAL_CHUNK}-token chunks"] = _serial(loaded, ids, SERIAL_CHUNK,
                                                                     device)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for repeat in range(repeats):
        for name, run in variants.items():
            start = numerics.clock()
            run()
            samples[name].append(numerics.clock() - start)
        out.write(f"repeat {repeat + 1}/{repeats} done\n")
        out.flush()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    base = medians["transformers, one shot"]
    out.write(f"\ncold prefill of {prompt_tokens} tokens ({model}) {numerics.describe()}, "
              f"median of {repeats}, variants interleaved:\n")
    out.write(f"{'variant':<34} {'seconds':>8} {'tokens/s':>9} {'vs one shot':>12}\n")
    for name, seconds in medians.items():
        out.write(f"{name:<34} {seconds:>8.2f} {prompt_tokens / seconds:>9.0f} "
                  f"{seconds / base:>11.2f}x\n")
    return medians


def _batched(loaded: LoadedModel, forward: BatchedForward, ids: torch.Tensor,
             size: int, device: torch.device) -> Callable[[], None]:
    def run() -> None:
        seq = KVSequence.alone(loaded.layout, int(ids.numel()), device=device)
        for begin in range(0, int(ids.numel()), size):
            chunk = ids[begin:begin + size]
            forward.forward([SequenceRows(sequence=seq, tokens=chunk,
                                          wants_logits=begin + size >= ids.numel())])
    return run


def _one_shot(loaded: LoadedModel, ids: torch.Tensor) -> None:
    with torch.inference_mode():
        loaded.transformers_model()(input_ids=ids.reshape(1, -1), logits_to_keep=1)


def _serial(loaded: LoadedModel, ids: torch.Tensor, size: int,
            device: torch.device) -> Callable[[], None]:
    def run() -> None:
        seq = KVSequence.alone(loaded.layout, int(ids.numel()), device=device)
        for begin in range(0, int(ids.numel()), size):
            end = min(int(ids.numel()), begin + size)
            forward_logits(loaded, ids[begin:end], make_sequence_cache(seq))
            seq.advance(end - begin)
    return run
