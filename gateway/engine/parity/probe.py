"""The start-up check that the batched forward really is invariant on these weights, here.

Why at start-up and on the real weights: invariance is a property of the kernels torch picks for
these shapes on this machine (docs/design.md, "Parity": other builds and devices behave otherwise).
The probe runs the same random prompt one-shot, in odd chunks, token by token, and side by side
with other sequences, and compares every layer's K/V and the logits bit for bit. If any differ,
the engine serves through the serial exact route and says why. It then decodes, alone, beside
other decoding sequences and beside prefilling ones (decode rows share the step's product or
are products of their own, ``gateway.engine.linear.row_products``), which must match too; and it
reports whether decode-time K/V equal the prefill's, which decides whether an answer's blocks
are stored as decoded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gateway.engine.attention.tiled import TILE
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from tiers.page_pool import PagePool
from tiers.payload import KVLayout

logger = logging.getLogger(__name__)

PROBE_TOKENS = 2 * TILE + 5
"""Prompt length: two tiles and a partial one."""

PROBE_PREFIX = 450
"""Positions before the prompt, computed once and copied into every run: the prompt then
crosses position 512 (a key block of ``gateway.engine.attention.flash``) 62 tokens in, at the
cost of one prefill of the prefix."""

NUM_DECODE = 3

NUM_CHECKS = 8
"""Variants the probe compares (the one-shot run, five chunked/batched ones, two decoding)."""


class ProbeCancelled(Exception):
    """The probe was asked to stop (the process is shutting down) before it had a verdict."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """What the probe found.

    Attributes:
        is_invariant: every variant matched the one-shot run bit for bit.
        failure: the first variant that did not match, and where (None when invariant).
        num_checks: variants compared.
        seconds: how long the probe took.
        decode_kv_is_prefill_kv: decoding wrote the K/V a prefill of the same tokens writes.
    """

    is_invariant: bool
    failure: str | None
    num_checks: int
    seconds: float
    decode_kv_is_prefill_kv: bool = False


@dataclass(frozen=True, slots=True)
class _Run:
    sequence: KVSequence
    logits: list[torch.Tensor]


def probe_invariance(forward: BatchedForward, layout: KVLayout, vocab_size: int, *,
                     seed: int = 0, num_tokens: int = PROBE_TOKENS,
                     clock: Callable[[], float] = time.perf_counter,
                     cancelled: Callable[[], bool] = lambda: False,
                     on_check: Callable[[int, int], None] | None = None) -> ProbeResult:
    """Compare one-shot, chunked, token-by-token and batched runs of one random prompt.

    Args:
        forward: the forward to probe (on the real weights and device).
        layout: the model's KV layout.
        vocab_size: token ids are drawn below it.
        seed: seed of the random prompt and of the other sequences.
        num_tokens: prompt length.
        clock: time source for ``seconds``.
        cancelled: polled before every forward; True raises ``ProbeCancelled``.
        on_check: called with (checks done, ``NUM_CHECKS``) after each comparison (progress).

    Raises:
        ProbeCancelled: ``cancelled()`` said so.
    """
    started = clock()
    generator = torch.Generator().manual_seed(seed)
    total = num_tokens + NUM_DECODE
    tokens = torch.randint(0, vocab_size, (total,), generator=generator)
    # A pool of its own, for the sequences alive at once (five runs, three others, the prefix).
    pool = PagePool(layout, page_tokens=TILE, device=forward.device,
                    num_pages=16 * -(-(PROBE_PREFIX + total) // TILE))
    # Recurrent layers' states are kept at the ends of pages only: such a prefix ends on one.
    num_prefix = PROBE_PREFIX - PROBE_PREFIX % TILE if forward.features.mixers else PROBE_PREFIX
    prefix = KVSequence(pool, num_prefix)
    forward.forward([SequenceRows(wants_logits=False, sequence=prefix,
                                  tokens=torch.randint(0, vocab_size, (num_prefix,),
                                                       generator=generator))])
    prefix_kv = [prefix.block(0, num_prefix)]

    def others(count: int) -> list[KVSequence]:
        """``count`` other sequences with histories of different lengths, decoding beside."""
        made = []
        for i in range(count):
            _check_cancelled(cancelled)
            n = 5 + 37 * i
            seq = KVSequence(pool, n + 2 * TILE)
            history = torch.randint(0, vocab_size, (n,), generator=generator)
            forward.forward([SequenceRows(sequence=seq, tokens=history, wants_logits=False)])
            made.append(seq)
        return made

    def run(chunks: Sequence[int], beside: int = 0, decoding: bool = False,
            company_prefills: bool = False) -> _Run:
        """``decoding``: the last NUM_DECODE one-token chunks, and the others', are decode rows
        (the others' are prefill rows with ``company_prefills``)."""
        seq = KVSequence.from_blocks(pool, prefix_kv, num_prefix + total)
        company = others(beside)
        logits: list[torch.Tensor] = []
        at = 0
        for size in chunks:
            _check_cancelled(cancelled)
            is_decode = decoding and at >= num_tokens
            batch = [SequenceRows(sequence=other, wants_logits=True,
                                  is_decode=is_decode and not company_prefills,
                                  tokens=torch.randint(0, vocab_size, (1,), generator=generator))
                     for other in company]
            batch.append(SequenceRows(sequence=seq, tokens=tokens[at:at + size],
                                      wants_logits=True, is_decode=is_decode))  # not the first
            mine = forward.forward(batch)[-1]
            assert mine is not None
            logits.append(mine)
            at += size
        return _Run(seq, logits)

    decode = [1] * NUM_DECODE
    reference = run([num_tokens, *decode])
    one_shot = run([total])
    variants: list[tuple[str, Sequence[int], int]] = [
        ("chunked by tile", [TILE, TILE, num_tokens - 2 * TILE, *decode], 0),
        ("chunked oddly", [37, 5, num_tokens - 42, *decode], 0),
        ("in chunks of 1, 2 and 3 tokens", [1, 2, 3, num_tokens - 6, *decode], 0),
        ("batched with other sequences", [num_tokens, *decode], 3),
        ("chunked and batched", [TILE + 1, num_tokens - TILE - 1, *decode], 2),
    ]
    done = 0

    def checked(found: str | None) -> str | None:
        nonlocal done
        done += 1
        if on_check is not None:
            on_check(done, NUM_CHECKS)
        return found

    failure = checked(_compare(reference, one_shot, "decode vs one-shot prefill", layout,
                               logits_steps=[(-1, -1)]))
    every_decode_step = [(-1 - i, -1 - i) for i in range(NUM_DECODE)]
    for name, chunks, beside in variants:
        if failure is not None:
            break
        failure = checked(_compare(reference, run(chunks, beside), name, layout,
                                   logits_steps=every_decode_step))
    decoded_alone = run([num_tokens, *decode], decoding=True)
    if failure is None:
        failure = checked(_compare(
            decoded_alone, run([num_tokens, *decode], beside=3, decoding=True),
            "decoding beside other decoding sequences", layout, logits_steps=every_decode_step))
    if failure is None:
        failure = checked(_compare(
            decoded_alone, run([num_tokens, *decode], beside=2, decoding=True,
                               company_prefills=True),
            "decoding beside prefilling sequences", layout, logits_steps=every_decode_step))
    same_kv = _compare(reference, decoded_alone, "", layout, logits_steps=()) is None
    return ProbeResult(is_invariant=failure is None, failure=failure,
                       num_checks=NUM_CHECKS, seconds=clock() - started,
                       decode_kv_is_prefill_kv=same_kv)


def _check_cancelled(cancelled: Callable[[], bool]) -> None:
    if cancelled():
        raise ProbeCancelled("the start-up probe was stopped before its verdict")


def _compare(expected: _Run, got: _Run, name: str, layout: KVLayout,
             logits_steps: Sequence[tuple[int, int]]) -> str | None:
    for layer in range(layout.num_layers):
        for kind, a, b in (("K", expected.sequence.keys(layer), got.sequence.keys(layer)),
                           ("V", expected.sequence.values(layer), got.sequence.values(layer))):
            if not torch.equal(a, b):
                return f"{name}: layer {layer} {kind} differs by {(a - b).abs().max().item():.3g}"
    for mine, theirs in logits_steps:
        a, b = expected.logits[mine], got.logits[theirs]
        if not torch.equal(a, b):
            return f"{name}: logits differ by {(a - b).abs().max().item():.3g}"
    return None
