"""The engine watchdog: a gateway whose worker thread has died must stop saying SERVING.

The step loop catches the errors of a step and keeps serving, but a bug can still end its thread
(an exception raised while handling another, a ``BaseException`` from a library). Nothing would
ever run again, yet health checks would go on answering SERVING and an orchestrator would keep
routing requests to a replica that can only time them out. The watchdog looks at the worker
every ``interval_s``; when it has died it calls ``on_death`` once -- the server then reports
NOT_SERVING, and ``kvgate serve`` exits non-zero so that its supervisor restarts it.

Its own small module (rather than a loop in the composition root) so that the in-process test
harness gets it with the server, exactly as ``kvgate serve`` does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class EngineWatchdog:
    """Polls ``is_dead`` on a thread of its own; calls ``on_death`` once when it turns true.

    Args:
        is_dead: whether the worker has died (``Engine.is_worker_dead``).
        on_death: called once, from the watchdog's thread, when it has.
        interval_s: seconds between looks.
    """

    def __init__(self, is_dead: Callable[[], bool], on_death: Callable[[], None], *,
                 interval_s: float = 0.25) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._is_dead = is_dead
        self._on_death = on_death
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.died = threading.Event()
        """Set once the worker was found dead (after ``on_death`` ran)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvgate-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (shutdown stops the worker on purpose)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self._is_dead():
                logger.error("the engine's worker thread has died: health is NOT_SERVING and "
                             "the gateway exits so that its supervisor restarts it")
                self._on_death()
                self.died.set()
                return
