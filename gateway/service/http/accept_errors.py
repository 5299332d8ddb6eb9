"""The HTTP front's event loop when descriptors run out: one log line per burst, no traceback.

When the process reaches its open-file limit (``EMFILE``; ``ENFILE``, ``ENOBUFS``, ``ENOMEM``
alike), asyncio's accept loop passes every failed ``accept()`` to the loop's exception handler,
whose default logs it at ERROR with a traceback. It does so up to ``backlog`` times per loop
tick (uvicorn listens with a backlog of 2,048), and schedules a retry for each: the review of
issue 44 counted 39 to 1,707 tracebacks per burst, and a lowered ``ulimit -n`` here 29,361 in
four seconds, which buried every other line. The retries still pending when the listener
closes end in ``ValueError: Invalid file descriptor: -1``, each with a traceback too.

``AcceptErrorLog`` is the loop's exception handler instead: such an error is counted and
logged as one WARNING line at most every ``interval_s`` (the first at once), saying how many
accepts failed since the last line and what to do; a late retry on a closed listener is
dropped; anything else goes to asyncio's default handler, as before. The connections that
could not be accepted stay in the listen queue and are taken once descriptors free up.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""What asyncio's accept loop treats as "out of system resource" (and retries a second later)."""

DEFAULT_INTERVAL_S = 10.0


class AcceptErrorLog:
    """An asyncio exception handler that turns accept failures for want of descriptors into
    one line per ``interval_s``.

    Args:
        interval_s: the least time between two lines.
        clock: monotonic seconds (a fake one in tests).

    Attributes:
        num_failed: accepts that failed for want of a resource, since start.
    """

    def __init__(self, *, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last_logged: float | None = None
        self._num_unlogged = 0
        self.num_failed = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS and "socket" in context:
            self._count(exc)
        elif isinstance(exc, ValueError) and _is_late_accept_retry(context):
            logger.debug("an accept retry ran after the HTTP listener closed: ignored")
        else:
            loop.default_exception_handler(context)

    def _count(self, exc: OSError) -> None:
        self.num_failed += 1
        self._num_unlogged += 1
        now = self._clock()
        if self._last_logged is not None and now - self._last_logged < self._interval_s:
            return
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        logger.warning(
            "HTTP front: cannot accept connections: %s (%s); %d accept(s) failed since the last "
            "such line; waiting connections are taken when descriptors free up. Raise the "
            "open-file limit (ulimit -n, LimitNOFILE) or lower [http] max_connections",
            exc.strerror, name, self._num_unlogged)
        self._last_logged = now
        self._num_unlogged = 0


def _is_late_accept_retry(context: dict[str, Any]) -> bool:
    """The context is a retry that asyncio scheduled after a failed accept, run once the
    listening socket had closed (its ``fileno()`` is -1)."""
    handle = context.get("handle")
    callback = getattr(handle, "_callback", None)
    return getattr(callback, "__name__", "") == "_start_serving"
