"""How the step loop words a request's end when it did not finish: why it stopped, and what ran
out.

Out of the loop's own module so that the loop reads as the loop; the words are what a client
reads (RESOURCE_EXHAUSTED / HTTP 429 for memory, CANCELLED, DEADLINE_EXCEEDED), so they say what
to do next.
"""

from __future__ import annotations

import torch

from gateway.core.errors import DeadlineExceeded, GatewayError, QueueFull, RequestCancelled
from gateway.engine.jobs import Job
from tiers.page_pool import PoolExhausted


def why_stopped(job: Job) -> GatewayError:
    """The error of a job that was cancelled or ran past its deadline."""
    if job.cancelled.is_set():
        return RequestCancelled("the request was cancelled")
    return DeadlineExceeded("the request ran past its deadline")


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation failed: CUDA's out-of-memory, or the CPU allocator's refusal."""
    return isinstance(exc, torch.OutOfMemoryError | PoolExhausted) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def out_of_memory(device: torch.device, what: str, exc: BaseException) -> QueueFull:
    """The refusal of ``what`` (a step, a request) that ran out of memory on ``device``."""
    if isinstance(exc, PoolExhausted):
        return QueueFull(f"no KV page was free for {what} ({exc}); retry later, with a "
                         "shorter prompt or fewer max_tokens")
    return QueueFull(
        f"the model's device ({device}) ran out of memory for {what}; retry later, "
        "with a shorter prompt or fewer max_tokens (an operator lowers [engine] "
        "kv_budget_bytes or max_running to fit the device)")


def release_memory(device: torch.device) -> None:
    """Give the allocator's cached blocks back after an out-of-memory (CUDA keeps them)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
