"""What the engine reports about each generation, as a seam the service's metrics implement.

The engine sits below the service (DESIGN.md, "Layout"), so it cannot import the Prometheus
metrics; it reports through this Protocol and the composition root hands it the real thing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class EngineMetrics(Protocol):
    """Receives the outcome of every generation, the queue depth and shadow verifications."""

    def record_generation(self, *, tenant: str, prompt_tokens: int,
                          cached_tokens_by_tier: dict[str, int], finish_reason: str,
                          ttft_s: float, total_s: float) -> None:
        """One generation that produced its answer (its ``Usage`` was sent)."""

    def record_failure(self, exc: BaseException) -> None:
        """A generation that ended without an answer (cancelled, deadline, refused, error)."""

    def set_queue_depth(self, depth: int) -> None:
        """The number of requests waiting for the engine."""

    def record_shadow_check(self, *, num_blocks: int, divergent_tiers: Sequence[str]) -> None:
        """One shadow verification (``gateway.engine.shadow``) of ``num_blocks`` served blocks;
        ``divergent_tiers`` names the tier of each that differed from cold ([] if none)."""
