"""What the engine reports about each generation, as a seam the service's metrics implement.

The engine sits below the service (docs/design.md, "Layout"), so it cannot import the Prometheus
metrics; it reports through this Protocol and the composition root hands it the real thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class EngineMetrics(Protocol):
    """Receives the outcome of every generation, each step, the queue depth and wait, the KV
    held, inter-token gaps, preemptions and shadow verifications.

    NOTE: the step loop calls these on its one thread, once per step or token: each must be
    cheap (a counter or histogram update), never I/O.
    """

    def record_generation(self, *, tenant: str, prompt_tokens: int,
                          cached_tokens_by_tier: dict[str, int], finish_reason: str,
                          ttft_s: float, total_s: float, completion_tokens: int = 0,
                          lossy: bool = False) -> None:
        """One generation that produced its answer (its ``Usage`` was sent); ``lossy``: it
        was computed on lossy copies of its prefix."""

    def record_failure(self, exc: BaseException) -> None:
        """A generation that ended without an answer (cancelled, deadline, refused, error)."""

    def set_queue_depth(self, depth: int) -> None:
        """The number of requests waiting for the engine."""

    def set_kv_in_use(self, num_bytes: int, *, num_tokens: int) -> None:
        """What the running requests hold now (set as that changes): ``num_bytes`` of pages,
        filled with ``num_tokens`` distinct tokens (a shared page counted once)."""

    def record_step(self, *, num_requests: int, num_tokens: int) -> None:
        """One step (one forward) of ``num_requests`` requests computing ``num_tokens``."""

    def record_queue_wait(self, wait_s: float) -> None:
        """A request admitted by the scheduler ``wait_s`` after it was submitted."""

    def record_inter_token(self, gap_s: float) -> None:
        """A generated token, ``gap_s`` after the previous token of the same request."""

    def record_preemption(self) -> None:
        """A running generation preempted for a better-priority request of its tenant."""

    def record_shadow_check(self, *, num_blocks: int, divergent_tiers: Sequence[str]) -> None:
        """One shadow verification (``gateway.engine.parity.shadow``) of ``num_blocks`` served
        blocks; ``divergent_tiers`` names the tier of each that differed from cold ([] if none)."""
