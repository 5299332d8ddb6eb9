"""``python -m gateway.bench.decode_steps``: a decode step eager against captured, side by side.

Why: a GPU decode step of a small model is bound by its launches, not its arithmetic, and
issue 24's target for it is relative to the time of reading the weights once (decode per
token at one user within 2x of it). This times, in one process and interleaved, the eager
batched forward's decode step and the same step from a captured bucket
(``gateway.engine.forward.captured_steps``), for several row counts over sequences of ``--context``
cached tokens, beside the time one pass over every weight takes here; where steps cannot be
captured (a CPU, another attention) it says why and times the eager step alone. Every figure
is the median of ``--repeats`` steps, each ending once the device is done.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from gateway.bench.numerics import BenchNumerics, resolve_numerics
from gateway.engine.forward.batched import BatchedForward, SequenceRows, StepForward
from gateway.engine.forward.captured_steps import CapturedSteps, captured_steps_problem
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import LoadedModel, ModelLoadError, load_model
from gateway.engine.parity.route_search import SearchSettings, build_forward, search_route
from tiers.page_pool import PagePool

PAGE_TOKENS = 64


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One row count's median step times (ms); ``captured_ms`` None where not captured."""

    rows: int
    eager_ms: float
    captured_ms: float | None


def weight_read_ms(loaded: LoadedModel, numerics: BenchNumerics, repeats: int) -> float:
    """The median time of one pass reading every weight (a sum over each tensor)."""
    weights = list(loaded.model.parameters())
    samples = []
    for _ in range(repeats + 1):
        start = numerics.clock()
        for weight in weights:
            torch.sum(weight, dtype=torch.float32)
        samples.append(numerics.clock() - start)
    return statistics.median(samples[1:]) * 1e3


def time_decode_steps(loaded: LoadedModel, forward: BatchedForward, numerics: BenchNumerics,
                      *, rows: Sequence[int], context: int, repeats: int,
                      captured: CapturedSteps | None,
                      captured_pool: PagePool | None) -> list[DecodeRow]:
    """Each row count's eager and captured decode step times over sequences of ``context``
    cached tokens (the captured ones in ``captured_pool``, a pool of their own)."""
    most = max(rows)
    capacity = sequence_capacity(context, repeats, rows)
    vocab = int(loaded.model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    eager_pool = _pool(loaded, most, capacity)

    def prefilled(pool: PagePool) -> list[KVSequence]:
        made = []
        for _ in range(most):
            seq = KVSequence(pool, capacity)
            tokens = torch.randint(0, vocab, (context,), generator=generator)
            forward.forward([SequenceRows(sequence=seq, tokens=tokens, wants_logits=False)])
            made.append(seq)
        return made

    eager_sequences = prefilled(eager_pool)
    captured_sequences = prefilled(captured_pool) if captured_pool is not None else []

    def step(run: StepForward, sequences: list[KVSequence], n: int) -> Callable[[], None]:
        def go() -> None:
            run.forward([SequenceRows(sequence=seq, wants_logits=True, is_decode=True,
                                      tokens=torch.randint(0, vocab, (1,), generator=generator))
                         for seq in sequences[:n]])
        return go

    out = []
    for n in rows:
        variants = {"eager": step(forward, eager_sequences, n)}
        if captured is not None:
            variants["captured"] = step(captured, captured_sequences, n)
        for go in variants.values():
            go()  # the first step of a bucket captures it
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, go in variants.items():
                start = numerics.clock()
                go()
                samples[name].append(numerics.clock() - start)
        medians = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
        out.append(DecodeRow(rows=n, eager_ms=medians["eager"],
                             captured_ms=medians.get("captured")))
    return out


def sequence_capacity(context: int, repeats: int, rows: Sequence[int]) -> int:
    """Tokens a sequence needs: its context, then a first and ``repeats`` timed decode steps
    per row count (the first sequence decodes in every one), with room to spare."""
    return context + 2 * (repeats + 1) * len(rows) + 8


def _pool(loaded: LoadedModel, sequences: int, capacity: int) -> PagePool:
    pages = sequences * -(-capacity // PAGE_TOKENS) + 8
    return PagePool(loaded.layout, page_tokens=PAGE_TOKENS, num_pages=pages,
                    device=loaded.device)


def run_decode_benchmark(*, model: str, rows: Sequence[int], context: int, repeats: int,
                         numerics: BenchNumerics, out: TextIO,
                         cache_dir: Path | None = None) -> list[DecodeRow]:
    """Print and return the decode step times of ``model`` (module docstring; ``cache_dir``:
    where ``bundled`` is converted)."""
    try:
        loaded = load_model(model, cache_dir=cache_dir, device=numerics.device,
                            dtype=numerics.dtype)
    except ModelLoadError as exc:
        raise SystemExit(f"decode_steps: {exc}") from None
    # Read while plain: the search leaves them laid out for its kernel, no module parameters.
    read_ms = weight_read_ms(loaded, numerics, repeats)
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    most = max(rows)
    verdict = search_route(loaded, SearchSettings(max_logit_rows=most,
                                                  max_rows=max(most, 256)))
    forward = build_forward(loaded, verdict)
    if not isinstance(forward, BatchedForward):
        raise SystemExit(f"the batched forward is not invariant here: {verdict.reason}")
    problem = captured_steps_problem(forward, loaded.device)
    captured = captured_pool = None
    if problem is None:
        captured_pool = _pool(loaded, most, sequence_capacity(context, repeats, rows))
        captured = CapturedSteps(forward, captured_pool, max_rows=most,
                                  max_positions=loaded.max_context, capture=True)
    out.write(f"decode steps {numerics.describe()}: {model}, {context} cached tokens a "
              f"sequence, median of {repeats}; route {verdict.attention} attention, "
              f"{verdict.kernel} products of at least {forward.products.padding.minimum} rows"
              + "".join(f", {out}x{in_} weights of at least {more.minimum}"
                        for (out, in_), more in forward.products.wider)
              + " (the padding a row keeps its bits under here)\n")
    if problem is not None:
        out.write(f"captured steps: not here ({problem})\n")
    out.write(f"reading every weight once: {read_ms:.2f} ms ({weight_bytes / 2**30:.2f} GiB, "
              f"{weight_bytes / read_ms / 1e6:.0f} GB/s)\n")
    measured = time_decode_steps(loaded, forward, numerics, rows=rows, context=context,
                                 repeats=repeats, captured=captured,
                                 captured_pool=captured_pool)
    out.write("rows | eager ms | captured ms | captured/eager | captured/weight read\n")
    for row in measured:
        if row.captured_ms is None:
            out.write(f"{row.rows} | {row.eager_ms:.2f} | - | - | -\n")
        else:
            out.write(f"{row.rows} | {row.eager_ms:.2f} | {row.captured_ms:.2f} | "
                      f"{row.captured_ms / row.eager_ms:.2f}x | "
                      f"{row.captured_ms / read_ms:.2f}x\n")
    if captured is not None:
        counters = captured.counters
        out.write(f"buckets captured: {counters.captured}, capture failures: "
                  f"{counters.capture_failures}\n")
    out.flush()
    return measured


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"row counts are positive integers, comma-separated, "
                                         f"got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.bench.decode_steps",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--model", required=True,
                        help="bundled, or a checkpoint directory (made by save_pretrained)")
    parser.add_argument("--data-dir", type=Path, default=Path("data"),
                        help="where bundled is converted (default data)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=_counts, default=[1, 8, 32],
                        help="decode rows a step (comma-separated; default 1,8,32)")
    parser.add_argument("--context", type=int, default=2048,
                        help="cached tokens of each sequence (default 2048)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if args.context < 1 or args.repeats < 1:
        parser.error("--context and --repeats must be >= 1")
    run_decode_benchmark(model=args.model, rows=args.rows, context=args.context,
                         repeats=args.repeats, numerics=resolve_numerics(args.device, args.dtype),
                         out=sys.stdout, cache_dir=args.data_dir / "models")
    return 0


if __name__ == "__main__":
    sys.exit(main())
