"""How the step loop words a request's end when it did not finish: why it stopped, and what ran
out.

Out of the loop's own module so that the loop reads as the loop; the words are what a client
reads (RESOURCE_EXHAUSTED / HTTP 429 for memory, CANCELLED, DEADLINE_EXCEEDED), so they say what
to do next.
"""

from __future__ import annotations

import logging

import torch

from gateway.core.errors import DeadlineExceeded, GatewayError, QueueFull, RequestCancelled
from gateway.engine.scheduling.jobs import Job
from tiers.page_pool import PoolExhausted

logger = logging.getLogger("gateway.engine.scheduling.loop")  # the loop's words, in the loop's log


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


def error_after_forward(exc: Exception, device: torch.device, job_id: int) -> BaseException:
    """What request ``job_id`` is told when what the loop does with its own output (sampling,
    detokenizing, stop matching, storing its blocks) raised ``exc``.

    Only the shared forward fails a whole step: anything after it belongs to one request, so
    its failure is that request's (issue 22: one request's temperature of 1e-45 ended every
    request in flight). The others' rows were computed without it (the forward is invariant),
    so what they are served does not change.
    """
    if is_out_of_memory(exc):
        logger.warning("request %d ran out of memory on %s after its forward: it is refused, "
                       "the engine goes on", job_id, device)
        error: BaseException = out_of_memory(device, "this request", exc)
        release_memory(device)
        return error
    # A bug, or a value nothing checked.
    logger.error("request %d failed after its forward; the others in the step go on", job_id,
                 exc_info=exc)
    error = RuntimeError(f"internal error handling this request's output "
                         f"({type(exc).__name__})")
    error.__cause__ = exc
    return error
