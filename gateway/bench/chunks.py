"""``kvgate bench chunks``: cold prefill time by chunk size, to choose ``block_tokens``.

Smaller blocks share more (a prefix is reused up to its last full block) but prefill in smaller
chunks, which runs the model's matmuls on smaller shapes. Sizes are measured round-robin within
each repeat, so a noisy neighbour slows every size alike; medians are printed with the ratio to
256-token chunks.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TextIO

import torch

from gateway.engine.kv_sequence import KVSequence
from gateway.engine.model import forward_logits, load_model, make_sequence_cache


def run_chunks_benchmark(*, model: str, cache_dir: Path, sizes: list[int], prompt_tokens: int,
                         repeats: int, out: TextIO) -> dict[int, float]:
    """Print and return the median cold prefill seconds of ``prompt_tokens`` per chunk size."""
    loaded = load_model(model, cache_dir=cache_dir)
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.tokenizer.vocab_size
    ids = torch.randint(0, vocab, (prompt_tokens,), generator=generator)
    samples: dict[int, list[float]] = {size: [] for size in sizes}
    for repeat in range(repeats):
        for size in sizes:
            seq = KVSequence(loaded.layout, prompt_tokens)
            start = time.perf_counter()
            for begin in range(0, prompt_tokens, size):
                end = min(prompt_tokens, begin + size)
                forward_logits(loaded, ids[begin:end], make_sequence_cache(seq))
                seq.advance(end - begin)
            samples[size].append(time.perf_counter() - start)
        out.write(f"repeat {repeat + 1}/{repeats} done\n")
        out.flush()
    medians = {size: statistics.median(values) for size, values in samples.items()}
    base = medians.get(256)
    out.write(f"\ncold prefill of {prompt_tokens} tokens ({model}), median of {repeats}, "
              f"sizes interleaved:\n")
    out.write(f"{'chunk':>6} {'seconds':>8} {'tokens/s':>9} {'vs 256':>7}\n")
    for size in sizes:
        ratio = f"{medians[size] / base:.2f}x" if base else "-"
        out.write(f"{size:>6} {medians[size]:>8.2f} {prompt_tokens / medians[size]:>9.0f} "
                  f"{ratio:>7}\n")
    return medians
