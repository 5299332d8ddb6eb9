"""Where one thread's time goes, by sampling its Python stack (issue 45, item 1).

Why sampling, not a tracer: cProfile and torch's profiler instrument every call, which on the
engine's step loop -- hundreds of small calls per step, most of the time inside torch ops --
changes what they measure. A sampler reads the thread's innermost frames every ``interval_s``
from a thread of its own (``sys._current_frames``) and files each sample under the first rule
that names one of the frames, innermost first; the work a frame starts in C (a product, the
paged C kernel, a tier's memcpy) is filed under the Python frame that called it. What a sample
costs the sampled thread is the sampler taking the GIL once per interval: a few microseconds
per millisecond.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType


@dataclass(frozen=True, slots=True)
class Rule:
    """A part of the work: the samples whose stack has a frame in one of ``files`` (a path's
    ending, or a folder: ``/gateway/cache/``) and, where ``functions`` is given, in one of
    those functions."""

    part: str
    files: tuple[str, ...]
    functions: tuple[str, ...] = ()

    def matches(self, frame: FrameType) -> bool:
        code = frame.f_code
        name = code.co_filename
        return (any(part in name if part.endswith("/") else name.endswith(part)
                    for part in self.files)
                and (not self.functions or code.co_name in self.functions))


IDLE = "waiting for work"
OTHER = "step loop, other Python"

ENGINE_RULES: tuple[Rule, ...] = (
    Rule(IDLE, ("/threading.py", "/queue.py"), ("wait", "get")),
    Rule("products (projections, experts)", ("/engine/linear/row_products.py",)),
    Rule("attention", ("/engine/attention/paged.py", "/engine/attention/tiled.py",
                       "/engine/attention/flash.py", "/engine/attention/triton_paged.py")),
    Rule("KV writes and page tables", ("/engine/kv/sequence.py", "/engine/kv/step_writes.py",
                                       "/tiers/page_pool.py")),
    Rule("sampling", ("/engine/output/sampling.py",)),
    Rule("detokenising and streaming", ("/engine/output/detokenizer.py",
                                        "/engine/output/observer.py", "/core/requests.py")),
    Rule("cache and tiers (placement, stores, moves)", ("/gateway/cache/", "/tiers/",
                                                        "/engine/scheduling/request_blocks.py")),
    Rule("scheduling", ("/engine/scheduling/scheduler.py", "/engine/scheduling/preemption.py")),
    Rule("forward: norms, rotary, embeddings, glue", ("/engine/forward/batched.py",
                                                      "/engine/forward/experts.py",
                                                      "/engine/forward/rotary.py")),
)
"""How the engine's step loop divides: the first rule naming a frame of a sample, innermost
frame first, takes it (so a product called from the forward is a product)."""


def classify(frame: FrameType | None, rules: Sequence[Rule]) -> str:
    """The part a stack whose innermost frame is ``frame`` belongs to (``OTHER`` where no
    rule names any of its frames)."""
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    for candidate in frames:  # innermost first
        for rule in rules:
            if rule.matches(candidate):
                return rule.part
    return OTHER


class StackSampler:
    """Samples thread ``thread_id``'s stack every ``interval_s`` between ``start`` and
    ``stop``; ``parts`` counts the samples by part."""

    def __init__(self, thread_id: int, *, rules: Sequence[Rule] = ENGINE_RULES,
                 interval_s: float = 0.001) -> None:
        self._thread_id = thread_id
        self._rules = tuple(rules)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self.parts: Counter[str] = Counter()

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> Counter[str]:
        """Stop sampling; the counts by part."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.parts

    def _run(self) -> None:
        while not self._stop.is_set():
            frame = sys._current_frames().get(self._thread_id)
            if frame is None:  # the thread ended
                return
            self.parts[classify(frame, self._rules)] += 1
            del frame
            time.sleep(self._interval_s)


def shares(parts: Counter[str]) -> list[tuple[str, float]]:
    """Each part's share of the samples, largest first."""
    total = sum(parts.values())
    if not total:
        return []
    return [(part, count / total) for part, count in parts.most_common()]
