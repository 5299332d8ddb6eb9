"""Choosing the next token from logits: greedy, or temperature / top-k / top-p with a seed.

Greedy is ``argmax`` of the float32 logits and nothing else, so that a warm request, whose
logits are bit-identical to a cold one's (DESIGN.md, "Parity"), picks the same token. Sampling
uses a generator owned by the request, seeded from the request, so the same seed gives the same
tokens whatever else the server is doing.
"""

from __future__ import annotations

import torch

from gateway.core.requests import SamplingParams


class Sampler:
    """Picks tokens for one request.

    Args:
        params: the request's sampling parameters.
        vocab_size: ids the tokenizer can represent; a model whose output layer is padded past
            them never gets those ids picked (they could not be decoded or sent back).
    """

    def __init__(self, params: SamplingParams, vocab_size: int | None = None) -> None:
        self.params = params
        self._vocab_size = vocab_size
        self._generator: torch.Generator | None = None
        if params.temperature > 0:
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
        if params.temperature == 0:
            return int(torch.argmax(logits).item())
        scores = logits.float() / params.temperature
        if 0 < params.top_k < scores.numel():
            threshold = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < threshold, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop = cumulative - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        choice = torch.multinomial(probs.cpu(), 1, generator=self._generator)
        return int(choice.item())
