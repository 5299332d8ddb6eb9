"""What the step loop is told (``LoopSettings``), keeps per request (``ActiveRequest``) and
reports (``LoopCounters``).

Records of their own so the engine builds and reads them without the loop's internals.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field

import torch

from gateway.cache.prefix_cache import Lease
from gateway.core.fingerprint import Namespace
from gateway.core.tokens import TokenIds
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.output.detokenizer import Detokenizer
from gateway.engine.output.sampling import Sampler
from gateway.engine.scheduling.jobs import Job
from tiers.payload import KVBlock


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopSettings:
    """What the loop needs besides the model, cache and scheduler.

    Attributes:
        block_tokens: the cache block size.
        default_ttl_s: TTL of stored blocks when a request names none.
        store_generated_blocks: store the blocks an answer fills.
        decode_kv_is_prefill_kv: decoding writes the K/V a prefill writes: an answer's blocks
            are stored as decoded.
        recompute_generated_blocks: otherwise, recompute them block-aligned and store them
            (the serial route); when False they are not stored (the batched route: the next
            turn of a conversation sends the answer back in its prompt, whose prefill stores
            it, cheaper than recomputing every answer in the loop when it ends).
    """

    block_tokens: int
    default_ttl_s: float | None
    store_generated_blocks: bool
    decode_kv_is_prefill_kv: bool
    recompute_generated_blocks: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopCounters:
    """What the loop has done since start (for Stats and tests).

    Attributes:
        num_steps: forwards run.
        num_prefill_tokens: prompt tokens computed (not loaded from the cache).
        num_decode_tokens: decode rows computed.
        max_sequences_in_step: the most requests one forward carried.
        num_dedup_waits: requests that waited for another's prefill of the same blocks
            instead of computing them too.
        num_preemptions: running generations preempted for a better-priority request of their
            tenant (each resumed later, or ended while it waited).
    """

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    max_sequences_in_step: int = 0
    num_dedup_waits: int = 0
    num_preemptions: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LeasedPrefix:
    """What a request leased from the cache at admission (``RequestBlocks.lease``).

    Attributes:
        lease: its lease in its own namespace (held until the request ends).
        namespace: that namespace.
        reads_own_namespace: the blocks came from it (not from the shared scope's longer match).
        blocks: the cached prefix's payloads, in order.
        cached_by_tier: the prefix's tokens by the tier each block came from.
        lossy: some of the blocks are lossy copies (the request allowed them): ``lease`` and
            ``namespace`` are then the lossy namespace's, where everything it computes on top
            of them is stored (docs/design.md, "Lossy tiers").
    """

    lease: Lease
    namespace: Namespace
    reads_own_namespace: bool
    blocks: list[KVBlock]
    cached_by_tier: dict[str, int]
    lossy: bool = False


@dataclass(slots=True, kw_only=True)
class ActiveRequest:
    """A request the step loop has admitted: its state across steps.

    ``tokens`` (and ``ids``, the same as a tensor) are what its sequence is computed over: its
    prompt, or for a preempted generation resumed its prompt and what it had generated
    (``target`` is their number).
    """

    job: Job
    seq: KVSequence
    tokens: TokenIds
    ids: torch.Tensor
    target: int
    stack: ExitStack
    lease: Lease | None = None
    namespace: Namespace | None = None
    reads_own_namespace: bool = False
    loaded_blocks: list[KVBlock] = field(default_factory=list)
    stored_new: int = 0
    ttl_s: float | None = None
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    lossy: bool = False
    """Some of what it attends to came from lossy copies: its answer is not the model's own."""
    sampler: Sampler | None = None
    detok: Detokenizer | None = None
    generated: list[int] = field(default_factory=list)
    next_token: int | None = None
    ttft_ms: float | None = None
    last_token_at: float | None = None  # the loop's clock, for the inter-token gap

    def take_prefix(self, prefix: LeasedPrefix) -> None:
        """Record what admission leased (the request's own record; nothing else writes it)."""
        self.lease, self.namespace = prefix.lease, prefix.namespace
        self.reads_own_namespace = prefix.reads_own_namespace
        self.lossy = self.lossy or prefix.lossy
        for tier, num_tokens in prefix.cached_by_tier.items():
            self.cached_by_tier[tier] = self.cached_by_tier.get(tier, 0) + num_tokens

    def carry_on(self, preempted: ActiveRequest) -> None:
        """Take over a preempted generation's own state: its sampler (the random generator
        where it samples, so the next draw is the one it would have made), detokenizer,
        tokens generated and timings; and the usage its first admission found (what its
        resumption finds in the cache is its own K/V, not a hit of the prompt's)."""
        self.sampler, self.detok = preempted.sampler, preempted.detok
        self.generated = preempted.generated
        self.ttft_ms, self.last_token_at = preempted.ttft_ms, preempted.last_token_at
        self.cached_by_tier = preempted.cached_by_tier
        self.lossy = self.lossy or preempted.lossy
