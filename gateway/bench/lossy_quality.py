"""The quality half of ``kvgate bench lossy`` (``gateway.bench.lossy``): its prompts, what it
computes with the model directly, and its table.

A quality prompt is a chat through the model's chat template: a prose document (the paragraphs
of ``gateway.bench.prompts``, one held out) as the system message and a question about it. The
engine answers it cold and with its prefix served lossy (``gateway.bench.lossy``); here the
model runs directly on the prefix's exact K/V and on its lossy copy -- the blocks encoded and
decoded by the lossy tier's own codec -- for the first generated step's logits and the
perplexity of the held-out paragraph.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import torch

from gateway.bench.prompts import PROSE
from gateway.core.canonical import PromptInput, canonicalize
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import LoadedModel, compute_block_kv, make_sequence_cache
from policies.base import BlockKey
from tiers.base import BlockMeta
from tiers.codec import BlockCodec
from tiers.page_pool import PagePool
from tiers.payload import KVBlock

AGREEMENT_TOKENS = 32
"""Greedy tokens compared with cold per quality prompt."""
QUESTIONS = (
    "In two or three sentences, what do the sections of these notes have in common?",
    "Which section of these notes is the most surprising, and why?",
    "Explain the first section of these notes to a child.",
    "What do these notes teach about patience? Answer in a short paragraph.",
)
"""The user's question after each quality prompt's document."""


@dataclass(frozen=True, slots=True, kw_only=True)
class QualityRow:
    """One quality prompt: agreement with cold, first-step logits, held-out perplexity."""

    prompt: int
    cold_tokens: int
    """Tokens the cold generation produced (fewer than ``AGREEMENT_TOKENS``: it ended)."""
    lossy_tokens: int
    cold_text: str
    lossy_text: str
    agreed: int
    """Generated tokens equal to cold's before the first difference (0..``AGREEMENT_TOKENS``)."""
    matched: int
    """Positions (of ``AGREEMENT_TOKENS``) where the two generations hold the same token."""
    max_logit_diff: float
    max_logit: float
    """The largest |logit| of the exact first step, for scale."""
    same_first_argmax: bool
    ppl_exact: float
    ppl_lossy: float

    @property
    def ppl_change(self) -> float:
        return self.ppl_lossy / self.ppl_exact - 1.0


def quality_texts(loaded: LoadedModel, num_tokens: int, held_out: int
                  ) -> tuple[list[int], list[int], list[int]]:
    """Prompt ``held_out``: a chat whose system message is a document of every paragraph of
    ``PROSE`` but one (from a different first paragraph per prompt) and whose user message asks
    about it, through the model's chat template; returned as its first ``num_tokens`` tokens
    (the cached prefix, inside the document), the rest (the suffix the request computes: the
    document's end, the question, the assistant's turn), and the held-out paragraph (never in
    the prompt)."""
    kept = [p for i, p in enumerate(PROSE) if i != held_out]
    kept = kept[held_out % len(kept):] + kept[: held_out % len(kept)]
    encode = loaded.tokenizer.encode
    document = f"Reading notes, part {held_out + 1}.\n\n"
    section = 0
    while len(encode(document, add_special_tokens=False)) <= num_tokens:
        document += f"Section {section + 1}. {kept[section % len(kept)]}\n\n"
        section += 1
    ids = [int(t) for t in canonicalize(PromptInput(messages=[
        {"role": "system", "content": document.strip()},
        {"role": "user", "content": QUESTIONS[held_out % len(QUESTIONS)]}]),
        loaded.tokenizer).token_ids]
    return (ids[:num_tokens], ids[num_tokens:],
            encode(f"\n\nSection {section + 1}. {PROSE[held_out]}", add_special_tokens=False))


def agreement(cold: Sequence[int], other: Sequence[int], n: int) -> tuple[int, int]:
    """(tokens equal before the first difference, positions equal) of two greedy generations
    of at most ``n`` tokens; a generation that ended (end of sequence) holds "ended" after its
    last token, so two that end alike agree there."""
    a = list(cold[:n]) + [-1] * (n - len(cold[:n]))
    b = list(other[:n]) + [-1] * (n - len(other[:n]))
    leading = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), n)
    return leading, sum(x == y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True, slots=True, kw_only=True)
class DirectQuality:
    """``direct_quality``'s figures (``QualityRow`` has their meaning)."""

    max_logit_diff: float
    max_logit: float
    same_first_argmax: bool
    ppl_exact: float
    ppl_lossy: float


def block_meta(tokens: Sequence[int]) -> BlockMeta:
    """The identity a codec encodes a block of ``tokens`` under (a key of its own)."""
    return BlockMeta(key=BlockKey(os.urandom(16)), parent_key=BlockKey(bytes(16)),
                     namespace_digest=bytes(32), owner="bench",
                     tokens=torch.tensor(list(tokens), dtype=torch.int64).numpy()
                     .astype("<u4").tobytes())


def lossy_copy(codec: BlockCodec, block: KVBlock, tokens: Sequence[int]) -> KVBlock:
    """What a lossy tier with ``codec`` serves of ``block`` (of ``tokens``): its blob, decoded,
    on ``block``'s device."""
    meta = block_meta(tokens)
    copy = codec.decode(codec.encode(meta, block), meta)
    device = block.keys[0].device
    return KVBlock(keys=tuple(t.to(device) for t in copy.keys),
                   values=tuple(t.to(device) for t in copy.values))


def direct_quality(loaded: LoadedModel, prefix: Sequence[int], suffix: Sequence[int],
                   held_out: Sequence[int], codec: BlockCodec,
                   block_tokens: int) -> DirectQuality:
    """The model run directly on the exact K/V of ``prefix`` (``compute_block_kv``) and on
    its lossy copy: the first generated step's logits after ``suffix`` (largest difference,
    largest magnitude, same argmax), and the perplexity of ``held_out`` given the prefix."""
    exact = [KVBlock(keys=k, values=v) for k, v in
             compute_block_kv(loaded, torch.tensor(list(prefix)), block_tokens)]
    lossy = [lossy_copy(codec, block, prefix[i * block_tokens:(i + 1) * block_tokens])
             for i, block in enumerate(exact)]
    step_exact, step_lossy = (logits_over(loaded, blocks, suffix, block_tokens)[-1]
                              for blocks in (exact, lossy))
    ppl_exact, ppl_lossy = (perplexity(logits_over(loaded, blocks, held_out, block_tokens),
                                       held_out) for blocks in (exact, lossy))
    return DirectQuality(max_logit_diff=float((step_exact - step_lossy).abs().max()),
                         max_logit=float(step_exact.abs().max()),
                         same_first_argmax=int(step_exact.argmax()) == int(step_lossy.argmax()),
                         ppl_exact=ppl_exact, ppl_lossy=ppl_lossy)


def logits_over(loaded: LoadedModel, blocks: Sequence[KVBlock], tokens: Sequence[int],
                block_tokens: int) -> torch.Tensor:
    """The model's float32 logits at every position of ``tokens`` run on top of ``blocks``
    (``[len(tokens), vocab]``)."""
    capacity = len(blocks) * block_tokens + len(tokens)
    pool = PagePool(loaded.layout, page_tokens=block_tokens, device=loaded.device,
                    num_pages=-(-capacity // block_tokens) + 1)
    sequence = KVSequence.from_blocks(pool, blocks, capacity)
    try:
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=loaded.device)
        with torch.inference_mode():
            output = loaded.transformers_model()(input_ids=ids,
                                                 past_key_values=make_sequence_cache(sequence),
                                                 use_cache=True)
        logits: torch.Tensor = output.logits[0].float()
        return logits
    finally:
        sequence.release()


def perplexity(logits: torch.Tensor, tokens: Sequence[int]) -> float:
    """exp of the mean negative log-likelihood of ``tokens[1:]`` under ``logits[:-1]``."""
    targets = torch.tensor(list(tokens[1:]), dtype=torch.long, device=logits.device)
    nll = torch.nn.functional.cross_entropy(logits[:-1], targets)
    return math.exp(float(nll))


def write_quality_table(rows: Sequence[QualityRow], q: str, num_tokens: int,
                        out: TextIO) -> None:
    n = AGREEMENT_TOKENS
    out.write(f"\nquality: {len(rows)} chats (a prose document as the system message, a "
              f"question about it), {num_tokens:,} tokens of each cached; cold (no_cache) "
              f"vs the prefix served from disk:{q}, greedy, {n} tokens\n")
    out.write(f"{'prompt':<8} {'tokens':>7} {'agreed':>7} {'matched':>8} {'max|dlogit|':>12} "
              f"{'max|logit|':>11} {'argmax':>7} {'ppl exact':>10} {'ppl ' + q:>10} "
              f"{'change':>8}\n")
    for row in rows:
        out.write(f"{row.prompt:<8} {row.cold_tokens:>4}/{row.lossy_tokens:<2} "
                  f"{row.agreed:>4}/{n:<2} {row.matched:>5}/{n:<2} "
                  f"{row.max_logit_diff:>12.4f} {row.max_logit:>11.2f} "
                  f"{'same' if row.same_first_argmax else 'differs':>7} {row.ppl_exact:>10.4f} "
                  f"{row.ppl_lossy:>10.4f} {row.ppl_change * 100:>+7.2f}%\n")
    total = n * len(rows)
    matched = sum(r.matched for r in rows)
    ppl_exact = math.exp(statistics.fmean(math.log(r.ppl_exact) for r in rows))
    ppl_lossy = math.exp(statistics.fmean(math.log(r.ppl_lossy) for r in rows))
    out.write(f"{'overall':<8} {'':>7} {sum(r.agreed for r in rows):>4}/{total:<2} "
              f"{matched:>5}/{total:<2} "
              f"{max(r.max_logit_diff for r in rows):>12.4f} "
              f"{max(r.max_logit for r in rows):>11.2f} "
              f"{sum(r.same_first_argmax for r in rows):>5}/{len(rows)} {ppl_exact:>10.4f} "
              f"{ppl_lossy:>10.4f} {(ppl_lossy / ppl_exact - 1) * 100:>+7.2f}%\n")
    out.write(f"tokens: generated cold / lossy (fewer than {n}: the answer ended; past its end "
              "an answer counts as 'ended', equal to another that ended there); agreed: tokens "
              f"equal to cold's before the first difference; matched: positions equal "
              f"({matched / total:.1%} overall); max|dlogit|: largest |logit| difference at the "
              f"first generated step, exact vs {q} prefix K/V (the model run directly; "
              "max|logit| for scale); argmax: the first token's; ppl: perplexity of a held-out "
              "paragraph (not in the prompt) given the prefix; overall: sums, maxima, geometric "
              "means\n")
    for row in rows:
        if row.agreed < n:
            out.write(f"prompt {row.prompt}, cold:     {row.cold_text!r}\n"
                      f"prompt {row.prompt}, {q + ':':<9} {row.lossy_text!r}\n")
