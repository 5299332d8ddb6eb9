"""How much recomputing cached tokens costs this engine: the cache's load-or-recompute yardstick.

Loading k cached tokens from a tier saves recomputing them, and nothing else: the step that
computes the suffix runs either way, with its fixed part (kernel launches, the last token's
logits and sampling, Python) paid once. Recomputed tokens cost their share of the steps they
fill: the *slope* of step time over step tokens, plus the fixed part spread over a full prefill
step's tokens (more tokens to recompute, more steps). That is what ``PrefillSpeed`` reports, not
a step's time divided by its tokens: the two differ little on a CPU, where every token costs the
same matmuls; on a GPU a 40-token suffix step is mostly fixed cost (~1 ms a token for the 8B
shape against ~0.04 ms a token in an 8k prefill), and dividing made every 8k load look 25 times
cheaper than recomputing it was, so a disk or Redis load slower than recomputing was chosen.

``PrefillSpeed`` fits the line by least squares over the latest prefill-only steps.
``StepTimer`` times the steps: on a CPU by the wall clock around the forward, on CUDA by events
recorded around it and read only once the GPU has passed them, so a step's figure is the GPU's
time (the forward returns before the GPU is done) and timing never makes the engine wait.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

WINDOW = 32
"""Prefill steps the slope is fitted over: recent enough to follow a change of load, enough to
include steps of several sizes (cold prefills and suffixes) in a mixed workload."""

MIN_SPREAD = 0.25
"""Least relative spread of step sizes (standard deviation over mean) for a slope: below it the
steps are too alike to separate the fixed part from the per-token one."""


@dataclass(slots=True)
class PrefillSpeed:
    """Seconds per recomputed token, from (tokens, seconds) of recent prefill steps.

    Attributes:
        step_tokens: a full prefill step's tokens (the engine's ``prefill_step_tokens``): the
            fixed part of a step is spread over that many.
        window: steps the line is fitted over.
    """

    step_tokens: int = 1024
    window: int = WINDOW
    _samples: deque[tuple[int, float]] = field(init=False)

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be >= 2 steps, got {self.window}")
        if self.step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {self.step_tokens}")
        self._samples = deque(maxlen=self.window)

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= 1 and seconds > 0:
            self._samples.append((num_tokens, seconds))

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    @property
    def s_per_token(self) -> float | None:
        """The fitted slope plus its intercept over ``step_tokens``, or None before any step.

        Steps too alike for a line (or a slope the noise made <= 0) give the time per token of
        the largest recent step instead: an upper bound (its fixed part divided among the most
        tokens), so the cache errs towards loading, as it did before any fit. The figure is
        never above that bound either.
        """
        if not self._samples:
            return None
        largest = max(self._samples)
        bound = largest[1] / largest[0]
        n = len(self._samples)
        mean_tokens = sum(t for t, _ in self._samples) / n
        mean_seconds = sum(s for _, s in self._samples) / n
        var = sum((t - mean_tokens) ** 2 for t, _ in self._samples) / n
        if n < 2 or var < (MIN_SPREAD * mean_tokens) ** 2:
            return bound
        cov = sum((t - mean_tokens) * (s - mean_seconds) for t, s in self._samples) / n
        slope = cov / var
        if slope <= 0:
            return bound
        fixed = max(0.0, mean_seconds - slope * mean_tokens)
        return min(slope + fixed / self.step_tokens, bound)


@dataclass(slots=True)
class _Pending:
    num_tokens: int
    start: torch.cuda.Event
    end: torch.cuda.Event


class StepTimer:
    """Times prefill steps into a ``PrefillSpeed`` without waiting for the device."""

    def __init__(self, device: torch.device, speed: PrefillSpeed | None = None) -> None:
        self._is_cuda = device.type == "cuda"
        self.speed = speed if speed is not None else PrefillSpeed()
        self._pending: deque[_Pending] = deque()

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Time what runs inside as one step of ``num_tokens`` prefilled tokens."""
        if not self._is_cuda:
            began = time.perf_counter()
            yield
            self.speed.record(num_tokens, time.perf_counter() - began)
            return
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        yield
        end.record()
        self._pending.append(_Pending(num_tokens, start, end))
        self.collect()

    def collect(self) -> None:
        """Record the steps the GPU has finished (in order); leave the others for later."""
        while self._pending and self._pending[0].end.query():  # type: ignore[no-untyped-call]
            done = self._pending.popleft()
            self.speed.record(done.num_tokens, done.start.elapsed_time(done.end) / 1e3)

    @property
    def s_per_token(self) -> float | None:
        self.collect()
        return self.speed.s_per_token
