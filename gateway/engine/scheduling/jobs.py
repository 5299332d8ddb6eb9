"""A submitted request as the gRPC thread and the step loop share it, and the handle to it.

The gRPC thread creates a ``Job`` and iterates its ``RequestHandle``; the step loop fills the
job's event queue and sets ``done``. The two never share anything else, so the only
synchronisation is the queue, the ``cancelled`` flag and the ``done`` event.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.requests import GenerateRequest, TokenDelta, Usage, WarmRequest, WarmResult
from gateway.core.tokens import TokenIds

Event = TokenDelta | Usage


@dataclass(slots=True, kw_only=True)
class Job:
    """One request from submission to its end (mutable: it is shared state, not a value)."""

    id: int
    kind: Literal["generate", "warm"]
    request: GenerateRequest | WarmRequest
    tokens: TokenIds
    submitted: float
    deadline: float
    events: queue.SimpleQueue[Event | BaseException | None] = field(
        default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    usage_sent: bool = False
    warm_result: WarmResult | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def tenant(self) -> str:
        return self.request.scope.owner


class RequestHandle:
    """A queued or running generation: iterate it for deltas, then one ``Usage``."""

    def __init__(self, job: Job) -> None:
        self._job = job

    def __iter__(self) -> Iterator[Event]:
        while True:
            item = self._job.events.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, Usage):
                return

    def cancel(self) -> None:
        """Stop the request at the next step (it releases its blocks then)."""
        self._job.cancelled.set()


class WarmHandle:
    """A submitted warm: ``result()`` waits for it; ``cancel()`` stops it at the next step.

    Args:
        job: the warm's job.
        then: run on the waiting thread once the warm succeeded, before ``result`` returns
            (saving the pin log of a warm that pins: not the loop's work, where an fsync would
            stall every request).
    """

    def __init__(self, job: Job, *, then: Callable[[], None] | None = None) -> None:
        self._job = job
        self._then = then

    def result(self) -> WarmResult:
        """Wait for the warm and return what it stored.

        Raises:
            GatewayError: it was cancelled, ran past its deadline or failed.
        """
        self._job.done.wait()
        if self._job.error is not None:
            raise self._job.error
        assert self._job.warm_result is not None
        if self._then is not None:
            self._then()
        return self._job.warm_result

    def cancel(self) -> None:
        self._job.cancelled.set()
