"""What a TTFT run records: timed samples, the table rows they form, the rows' labels.

Shared by the gateway's rows (``gateway.bench.ttft``), the references (``gateway.bench.peers``)
and the report, so that none of them imports another for a record type. ``BenchError``, the
one error of every part of the run, lives here for the same reason.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a process did not start, a prompt is too long)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One timed request."""

    seconds: float
    cached_tokens: int
    served_from: str
    server_ms: float | None = None


@dataclass(slots=True, kw_only=True)
class Row:
    """One line of a table: a system in one state, its samples, or why it has none."""

    label: str
    system: str
    samples: list[Sample] = field(default_factory=list)
    note: str | None = None
    tier: str | None = None
    """The tier a kvgate row is meant to be served from (what the targets check)."""

    @property
    def median_s(self) -> float | None:
        return statistics.median(s.seconds for s in self.samples) if self.samples else None

    @property
    def server_median_ms(self) -> float | None:
        values = [s.server_ms for s in self.samples if s.server_ms is not None]
        return statistics.median(values) if values else None

    @property
    def cached_text(self) -> str:
        counts = sorted({s.cached_tokens for s in self.samples})
        return "/".join(str(c) for c in counts) if counts else "-"

    @property
    def served_text(self) -> str:
        counts = Counter(s.served_from for s in self.samples)
        if len(counts) == 1:
            return next(iter(counts))
        return ", ".join(f"{where} x{n}" for where, n in counts.most_common())

    @property
    def is_served_as_meant(self) -> bool:
        """Every sample came (entirely) from the intended tier."""
        if self.tier is None or not self.samples:
            return False
        return all(s.served_from == f"{self.tier}:{s.cached_tokens}" and s.cached_tokens > 0
                   for s in self.samples)


@dataclass(slots=True, kw_only=True)
class LengthResult:
    prefix_tokens: int
    rows: list[Row] = field(default_factory=list)

    def row(self, label: str) -> Row | None:
        return next((r for r in self.rows if r.label == label), None)


COLD = "kvgate cold (no_cache)"
DEVICE = "kvgate warm: device"
HOST = "kvgate warm: host"
DISK = "kvgate warm: disk"
REDIS = "kvgate warm: redis"
HF_COLD = "HF recipe cold"
HF_WARM = "HF recipe warm (deepcopy)"
HF_SUFFIX = "HF suffix only (cache ready)"
PINNED_COPY = "pinned -> device copy of prefix K/V"
LLAMA_COLD = "llama.cpp cold"
LLAMA_RAM = "llama.cpp RAM-cache warm"
LLAMA_DISK = "llama.cpp disk-cache warm"
COLD_OF = {"kvgate": COLD, "hf": HF_COLD, "llama.cpp": LLAMA_COLD}
