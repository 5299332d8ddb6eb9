"""The stages of ``kvgate serve``'s start-up, each logged as it starts and ends, and the
interruption that stops any of them when the operator asks.

Why: a start can take a minute the first time (converting the bundled GGUF, searching the
route and probing it), and an operator watching a silent terminal cannot tell a slow start from
a hung one, nor stop it: the signal handler used to set a flag that only the serving loop read.
Now each stage says when it starts, how long it took, and ``StartInterrupted`` (raised in the
main thread by the signal handler, the way Python raises KeyboardInterrupt) ends whatever stage
is running; the engine's worker polls the same stop flag between forwards. Files are written to
a temporary name and renamed, and a conversion cut short removes its temporary directory, so an
interrupted start leaves no half-written file.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger("gateway.service.startup")


class StartInterrupted(Exception):
    """SIGINT or SIGTERM arrived before the gateway was serving: start-up stops where it is."""


@contextmanager
def stage(name: str, *, clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
    """Log ``name``'s start and its duration (or that it was interrupted)."""
    logger.info("start-up: %s ...", name)
    started = clock()
    try:
        yield
    except StartInterrupted:
        logger.info("start-up: %s interrupted after %.1f s", name, clock() - started)
        raise
    logger.info("start-up: %s done in %.1f s", name, clock() - started)


class StopSignals:
    """SIGINT and SIGTERM handling for ``kvgate serve``.

    A signal always sets ``stop_requested`` (the serving loop's cue to shut down gracefully).
    Before ``serving`` is set, the first signal also raises ``StartInterrupted`` in the main
    thread, so a stage in progress (a conversion, a model load, the wait for the route search)
    ends at once instead of running to its end first.
    """

    def __init__(self) -> None:
        self.stop_requested = threading.Event()
        self.serving = threading.Event()
        self.interruption: StartInterrupted | None = None
        """The ``StartInterrupted`` raised, once raised. A library running when it arrived may
        catch it and raise an error of its own instead (torch turns it into a ValueError while
        it reads a checkpoint), so an error that ends start-up after this is set is the
        interruption's doing, not a fault to report."""

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested.set()
        if not self.serving.is_set() and self.interruption is None:
            self.interruption = StartInterrupted(f"{signal.Signals(signum).name} during start-up")
            raise self.interruption
