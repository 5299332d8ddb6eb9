"""Pins: which blocks are pinned, and keeping that set over a restart.

A pin is a flag on a block's record (``BlockRecord.is_pinned``: no policy evicts it, it never
expires), set by an operator (``PrefixCache.set_pinned``) and cleared by an unpin or when an
operator's eviction takes the block's last copy (``TierPlacement.evict_copy``). The flag lives
in memory; what outlives a kill -9 is the pin log beside the disk tier's blocks
(``gateway.cache.base.PinLog``: ``tiers.pin_manifest``), from which restart adoption
(``gateway.cache.operations.adoption``) pins the blocks it finds on disk again.

``PinnedBlocks`` keeps the pinned records by key, under the cache lock, so that saving the set
costs O(pins), not a walk of the index under the lock every request needs. ``PinKeeper`` saves
it whenever it changed: one save at a time, each a snapshot taken after the change that asked
for it, so the last save written is never older than the last change.

NOTE: the save runs on the thread that changed the pins (an admin call, an admin eviction),
after the cache lock, before that call returns: an acknowledged pin is durable. A warm that
pins is pinned on the engine's loop, which does not save (an fsync there would stall every
request); the warm's own thread saves before its result is returned. Pins need an admin key,
so these fsyncs are rare and never on an ordinary request.
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from typing import Protocol

from gateway.cache.base import PinLog
from gateway.cache.radix_index import BlockRecord, RadixIndex
from policies.base import BlockKey


class PinnedBlocks:
    """The pinned records by key, and whether the set changed since it was last saved.

    Not thread-safe: called under the cache lock (``TierPlacement.locked``).
    """

    def __init__(self) -> None:
        self._key_to_record: dict[BlockKey, BlockRecord] = {}
        self._is_changed = False

    @property
    def is_changed(self) -> bool:
        """Whether the set changed since ``take_changed`` last returned it."""
        return self._is_changed

    def set(self, record: BlockRecord, is_pinned: bool) -> bool:
        """Pin (or unpin) ``record``; whether that changed it."""
        if record.is_pinned == is_pinned:
            return False
        record.is_pinned = is_pinned
        if is_pinned:
            self._key_to_record[record.key] = record
        else:
            self._key_to_record.pop(record.key, None)
        self._is_changed = True
        return True

    def records(self) -> list[BlockRecord]:
        """The pinned records."""
        return [record for record in self._key_to_record.values() if record.is_pinned]

    def mark_changed(self) -> None:
        """Save the set at the next chance even if no pin changed (a manifest read at restart
        that names blocks no longer there, a save the disk refused)."""
        self._is_changed = True

    def take_changed(self, index: RadixIndex) -> list[BlockKey] | None:
        """The keys of the pinned blocks still indexed, if the set changed since the last call
        (None if it did not). Records that left the index pinned (dropped after a failed
        write) are forgotten here."""
        if not self._is_changed:
            return None
        self._is_changed = False
        gone = [key for key, record in self._key_to_record.items()
                if not record.is_pinned or index.get(key) is not record]
        for key in gone:
            del self._key_to_record[key]
        return list(self._key_to_record)


class PinnedPlacement(Protocol):
    """What ``PinKeeper`` needs of the placement (``TierPlacement``)."""

    @property
    def pins(self) -> PinnedBlocks: ...

    @property
    def index(self) -> RadixIndex: ...

    def locked(self) -> AbstractContextManager[None]: ...


class PinKeeper:
    """Saves the pinned set to ``log`` whenever it changed (see the module docstring).

    Args:
        placement: whose pins are kept.
        log: where they are kept (None: nowhere; pins then end with the process).
    """

    def __init__(self, placement: PinnedPlacement, log: PinLog | None) -> None:
        self._placement = placement
        self._log = log
        self._save_lock = threading.Lock()

    def keep(self) -> None:
        """Save the pinned set if it changed since the last save (call it without the cache
        lock, after the change)."""
        if self._log is None:
            return
        # NOTE: the flag is read under both locks, never before them: a caller whose change
        # another thread's save is writing waits here until that save is durable.
        with self._save_lock:
            with self._placement.locked():
                keys = self._placement.pins.take_changed(self._placement.index)
            if keys is not None and not self._log.save(keys):
                with self._placement.locked():
                    self._placement.pins.mark_changed()  # the next change saves it again
