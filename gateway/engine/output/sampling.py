"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with a seed.

Greedy is ``argmax`` of the float32 logits and nothing else, so that a warm request, whose
logits are bit-identical to a cold one's (docs/design.md, "Parity"), picks the same token. Sampling
uses a generator owned by the request, seeded from the request, so the same seed gives the same
tokens whatever else the server is doing.

Every ``SamplingParams`` that validation accepts gives a distribution ``torch.multinomial``
takes: a temperature below ``MIN_SAMPLING_TEMPERATURE`` is greedy; the logits are shifted so
that the largest is 0 before they are divided by the temperature, so the quotients lie in
[-inf, 0] and softmax sees one 0 (never ``inf``, never NaN); top-p keeps the most likely token
whatever its mass. Logits that are not finite themselves (a broken model) give their argmax:
there is no distribution to sample from. A request's sampler raising would fail that request
alone (``gateway.engine.scheduling.loop``), but it should not raise for anything a client can send.
"""

from __future__ import annotations

import torch

from gateway.core.requests import SamplingParams


class Sampler:
    """Picks tokens for one request.

    Args:
        params: the request's sampling parameters (valid: ``params.problems()`` is empty).
        vocab_size: ids the tokenizer can represent; a model whose output layer is padded past
            them never gets those ids picked (they could not be decoded or sent back).
    """

    def __init__(self, params: SamplingParams, vocab_size: int | None = None) -> None:
        self.params = params
        self._vocab_size = vocab_size
        self._generator: torch.Generator | None = None
        if not params.is_greedy:
            self._generator = torch.Generator()
            if params.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(params.seed)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token id from one position's logits (1-D, float32)."""
        params = self.params
        if self._vocab_size is not None and logits.numel() > self._vocab_size:
            logits = logits[: self._vocab_size]
        if params.is_greedy:
            return int(torch.argmax(logits).item())
        top = logits.max()
        if not torch.isfinite(top):  # +inf or NaN among the logits, or all -inf
            return int(torch.argmax(logits).item())
        scores = (logits.float() - top.float()) / params.temperature
        if 0 < params.top_k < scores.numel():
            threshold = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < threshold, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p, and always the first token:
            # compared in float32, a top_p below its smallest number is 0 and would drop all.
            drop = cumulative - sorted_probs >= params.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        choice = torch.multinomial(probs.cpu(), 1, generator=self._generator)
        return int(choice.item())
