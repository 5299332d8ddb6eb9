"""The expiry sweeper: expired blocks leave every tier on time, not when a request meets them.

An expired block is never served (a lookup stops at it), but until something removes it, it
holds device and host memory, a file on disk, a Redis key -- and a tenant that asked for a TTL
was promised its prompt's KV would be gone after it. ``ExpirySweeper`` calls
``PrefixCache.sweep_expired`` every ``interval_s`` on a thread of its own; the sweep removes
every expired block that nothing uses from every local tier (Redis expires its keys by their
own ``PX``). Each sweep also ends the sessions idle for ``[cache] session_ttl_s``
(``gateway.cache.operations.session_admin.drop_expired_sessions``: their blocks leave every
tier, Redis included, and their tails go), and gives every pinned block its copy on the tier a
restart finds again where a write there failed (``restore_pinned_copies``: a disk that was full
when the pin was set, or when the block came). It is started by
``gateway.cache.operations.factory.open_cache`` and stopped before the stores close.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gateway.cache.operations.session_admin import drop_expired_sessions
from gateway.cache.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


def restore_pinned_copies(cache: PrefixCache) -> int:
    """Copy each pinned block to every tier that keeps pins over a restart and has lost or
    never got its copy (``TierPlacement.keep_pinned_copies``), then save the pin log if a
    save of it failed; returns how many copies were asked for. A copy that fails again is
    asked for again at the next sweep."""
    placement = cache.placement
    transfers = cache.transfers
    failed = {} if transfers is None else transfers.drain_failed()
    with placement.locked():
        placement.forget_failed_writes(failed)  # so that a copy whose write failed is missed
        for record in placement.pins.records():
            placement.keep_pinned_copies(record)
        moves = placement.take_moves()
    cache.run_moves(moves)
    cache.keep_pins()
    return len(moves)


class ExpirySweeper:
    """Sweeps ``cache`` every ``interval_s`` seconds until stopped.

    Args:
        cache: the cache to sweep.
        interval_s: seconds between sweeps.
    """

    def __init__(self, cache: PrefixCache, *, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._cache = cache
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_swept = 0
        """Tier copies removed so far."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvgate-sweeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sweeping (before the stores close) and wait for a sweep in progress."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            removed = self._cache.sweep_expired()
            self.num_swept += removed
            if removed:
                logger.debug("sweeper: %d expired block copies removed", removed)
            # Each chore on its own: one that fails leaves the others to run, and the next
            # sweep tries it again (the sweeper must not die).
            for chore, done_what in _CHORES:
                try:
                    done = chore(self._cache)
                except Exception:
                    logger.exception("sweeper: %s failed", chore.__name__)
                    continue
                if done:
                    logger.debug("sweeper: %d %s", done, done_what)


_CHORES: tuple[tuple[Callable[[PrefixCache], int], str], ...] = (
    (drop_expired_sessions, "expired sessions ended"),
    (restore_pinned_copies, "pinned blocks copied again to the tiers a restart reads"),
)
"""What each sweep does after removing expired blocks, and what its count counts."""
