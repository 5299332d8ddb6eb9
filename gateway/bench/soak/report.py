"""What a soak run found: its outcomes judged against the fault windows, the processes'
samples over time, and the verdict (``problems``: empty when the run passed)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from gateway.bench.soak.faults import GRACE_S, FaultWindow
from gateway.bench.soak.pins import PinCheck
from gateway.bench.soak.processes import ProcessSample
from gateway.bench.soak.workload import CHECKED_KINDS, Outcome

EXPECTED_IN_A_FAULT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})
"""Error classes a request may end with inside a fault's window (the path it needed was down
or slow); any other class, or any error outside a window, fails the run."""

STEADY_AFTER_S = 600.0
"""How long after a replica starts its memory counts as steady: its device and host tiers fill
in the first minutes, and what grows after that is what a leak would look like."""

MAX_RSS_GROWTH = 0.05
"""The most a replica's resident memory may grow over a steady stretch before the run fails."""


@dataclass(frozen=True, slots=True)
class Sampled:
    """A process's sample at a time (seconds from the load's start)."""

    at_s: float
    process: str
    sample: ProcessSample


@dataclass(slots=True)
class SoakReport:
    outcomes: list[Outcome]
    windows: list[FaultWindow]
    samples: list[Sampled]
    started: float
    warmup_s: float
    crashed: list[str] = field(default_factory=list)
    not_run: dict[str, str] = field(default_factory=dict)
    """Faults this run does not make, and why (a standalone run: the cluster's failover)."""
    pins: list[PinCheck] = field(default_factory=list)
    """The pinned prefixes as the end check found them (``gateway.bench.soak.pins``)."""

    def in_a_fault(self, outcome: Outcome) -> bool:
        return any(w.started <= outcome.ended and outcome.started <= w.ended + GRACE_S
                   for w in self.windows)

    def problems(self) -> list[str]:
        """Why the run failed (empty: it passed)."""
        found = [f"{name} exited on its own (not killed by a fault)" for name in self.crashed]
        wrong = [o for o in self.outcomes if o.result == "wrong"]
        if wrong:
            found.append(f"{len(wrong)} wrong answers (not the cold answer), first "
                         f"{wrong[0].prompt} from replica {wrong[0].replica}")
        for outcome in self.outcomes:
            if outcome.result != "error":
                continue
            if not self.in_a_fault(outcome):
                found.append(f"{outcome.kind} failed with {outcome.error} outside any fault "
                             f"window (+{outcome.started - self.started:.1f} s)")
            elif outcome.error not in EXPECTED_IN_A_FAULT:
                found.append(f"{outcome.kind} failed with {outcome.error} during a fault")
        for pin in self.pins:  # pins are kept over restarts (gateway.cache.pins): a loss fails
            if not pin.is_kept:
                found.append(f"pinned prefix {pin.prompt} lost on {pin.replica}: "
                             + (pin.error or f"{pin.disk_tokens} of its {pin.pinned_tokens} "
                                f"tokens on disk, {pin.served_tokens} served warm, "
                                f"{'equal to' if pin.is_equal else 'NOT'} the cold answer"))
        for process in sorted({s.process for s in self.samples}):
            growth = self.growth(process) if process.startswith("replica") else None
            if growth is not None and growth > MAX_RSS_GROWTH:
                found.append(f"{process}'s resident memory grew {growth:+.1%} from "
                             f"{STEADY_AFTER_S / 60:.0f} minutes after a start to the end of "
                             f"that life (at most {MAX_RSS_GROWTH:+.0%})")
        return found

    def recovery_s(self, window: FaultWindow) -> float | None:
        """From the fault's end to the first good checked answer that started after it."""
        after = [o.ended for o in self.outcomes if o.started >= window.ended
                 and o.result == "ok" and o.kind in CHECKED_KINDS]
        return min(after) - window.ended if after else None

    def growth(self, process: str) -> float | None:
        """Resident memory growth of ``process`` over its steady stretches, as a fraction: the
        largest, over each of its lives (from a start to the next kill, or to the end), from
        ``STEADY_AFTER_S`` after that start (and after warm-up) to the life's last sample; None
        when no life lasted long enough to have two samples there."""
        rss = [(s.at_s, s.sample.rss_bytes) for s in self.samples if s.process == process]
        lives: list[list[tuple[float, int]]] = [[]]
        start = 0.0
        previous: int | None = None
        for at, now in rss:
            if now is None:
                previous = None
                continue
            # gone and back, or restarted between two samples (a new process is far smaller)
            if previous is None or now < previous // 2:
                start = at
                if lives[-1]:
                    lives.append([])
            previous = now
            if at >= max(self.warmup_s, start + STEADY_AFTER_S):
                lives[-1].append((at, now))
        growths = [(life[-1][1] - life[0][1]) / life[0][1] for life in lives if len(life) >= 2]
        return max(growths) if growths else None

    def write(self, out: TextIO) -> None:
        checked = [o for o in self.outcomes if o.kind in CHECKED_KINDS]
        results = Counter(o.result for o in self.outcomes)
        out.write(f"kvgate bench soak: {len(self.outcomes)} requests "
                  f"({len(checked)} answers checked against the cold answer), "
                  f"{len(self.windows)} faults\n\n")
        out.write(f"{'result':<12}{'count':>8}\n" + "-" * 20 + "\n")
        for result in ("ok", "refused", "wrong", "error"):
            out.write(f"{result:<12}{results.get(result, 0):>8}\n")
        errors = Counter((o.error, self.in_a_fault(o)) for o in self.outcomes
                         if o.result == "error")
        if errors:
            out.write("\nerrors by class: " + ", ".join(
                f"{name} {'in a fault' if inside else 'OUTSIDE faults'}: {n}"
                for (name, inside), n in sorted(errors.items())) + "\n")
        tiers: Counter[str] = Counter()
        for outcome in checked:
            tiers.update(outcome.tiers)
        out.write("cached tokens by tier: " + (", ".join(
            f"{tier} {n:,}" for tier, n in sorted(tiers.items())) or "none") + "\n\n")
        out.write(f"{'fault':<24}{'at s':>8}{'lasted s':>10}{'recovered s':>13}  what\n")
        out.write("-" * 80 + "\n")
        for window in self.windows:
            recovered = self.recovery_s(window)
            out.write(f"{window.kind:<24}{window.started - self.started:>8.1f}"
                      f"{window.ended - window.started:>10.1f}"
                      f"{'-' if recovered is None else f'{recovered:.1f}':>13}  {window.note}\n")
        for name, why in self.not_run.items():
            out.write(f"{name:<24}{'not run':>31}  {why}\n")
        if self.pins:
            kept = sum(pin.is_kept for pin in self.pins)
            out.write(f"\npinned prefixes after each replica's last kill -9 and restart: "
                      f"{kept} of {len(self.pins)} kept on disk and served warm and equal to "
                      f"the cold answer; {len(self.pins) - kept} lost\n")
        out.write("\n" + f"{'process':<12}{'RSS MiB first/last':>20}{'growth':>9}"
                  f"{'fds first/last':>16}{'threads first/last':>20}\n")
        for process in sorted({s.process for s in self.samples}):
            seen = [s.sample for s in self.samples if s.process == process
                    and s.sample.rss_bytes is not None]
            if not seen:
                continue
            growth = self.growth(process)
            out.write(f"{process:<12}{_pair(seen, 'rss_bytes', 1 << 20):>20}"
                      f"{'-' if growth is None else f'{growth:+.1%}':>9}"
                      f"{_pair(seen, 'open_fds', 1):>16}{_pair(seen, 'threads', 1):>20}\n")
        problems = self.problems()
        out.write("\n" + ("PASSED: no wrong answer, no unexpected error, no crash\n"
                          if not problems else "FAILED:\n" + "".join(
                              f"  - {p}\n" for p in problems[:20])))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({
            "outcomes": [asdict(o) for o in self.outcomes],
            "faults": [asdict(w) | {"recovery_s": self.recovery_s(w)} for w in self.windows],
            "not_run": self.not_run,
            "pins": [asdict(pin) | {"is_kept": pin.is_kept} for pin in self.pins],
            "samples": [{"at_s": s.at_s, "process": s.process, **asdict(s.sample)}
                        for s in self.samples],
            "problems": self.problems(),
        }, indent=1), encoding="utf-8")


def _pair(samples: Sequence[ProcessSample], name: str, unit: int) -> str:
    values = [getattr(s, name) for s in samples if getattr(s, name) is not None]
    return f"{values[0] // unit}/{values[-1] // unit}" if values else "-"

