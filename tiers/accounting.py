"""The bookkeeping every in-memory store keeps alike: entries by key under one lock, and the
counters of ``StoreCounters`` kept in step with them.

``AccountedStore`` keeps it once (as cachetools' ``Cache`` keeps its size accounting once and
``LRUCache``/``TTLCache`` override only the order): ``contains``, ``delete`` (counted),
``stats`` (a ``StoreReport`` snapshot, with the store's own notes) and ``close``. A store says
only what differs: what an entry is and how many bytes it holds (``_entry_bytes``), what giving
one back means (``_release``: a slot back to its pool once its copies are done, a page's
reference dropped), its notes (``_notes``), and its own ``put`` and ``get``, which call ``_add``
and ``_count_lookup`` under ``_lock``.
"""

from __future__ import annotations

import dataclasses
import threading
from abc import ABC, abstractmethod
from typing import Generic, TypeVar

from gateway.core.admin_reports import StoreReport
from policies.base import BlockKey
from tiers.base import BatchDefaults, StoreCounters

EntryT = TypeVar("EntryT")


class AccountedStore(BatchDefaults, ABC, Generic[EntryT]):
    """Entries by key, one lock, counters in step (see the module docstring).

    Args:
        name: the store's name in stats (the tier's name).
    """

    def __init__(self, *, name: str) -> None:
        self.name = name
        self._entries: dict[BlockKey, EntryT] = {}
        self._lock = threading.Lock()
        self._stats = StoreCounters(name=name)

    # -- what a store says about its entries ------------------------------------------------

    @abstractmethod
    def _entry_bytes(self, entry: EntryT) -> int:
        """Bytes ``entry`` holds (what ``num_bytes`` counts)."""

    def _release(self, key: BlockKey, entry: EntryT) -> None:
        """Give back what ``entry`` holds, once it left the store. Called under the lock."""

    def _notes(self) -> dict[str, int | float | str]:
        """The store's own figures for ``stats().notes``. Called under the lock."""
        return {}

    # -- kept once ---------------------------------------------------------------------------

    def _add(self, key: BlockKey, entry: EntryT) -> None:
        """Keep ``entry`` under ``key`` (not held yet), counted. Hold the lock."""
        self._entries[key] = entry
        self._stats.num_blocks += 1
        self._stats.num_bytes += self._entry_bytes(entry)

    def _count_lookup(self, entry: EntryT | None) -> EntryT | None:
        """Count a hit or a miss for what a lookup found; returns it. Hold the lock."""
        if entry is None:
            self._stats.misses += 1
        else:
            self._stats.hits += 1
        return entry

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: BlockKey) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._release(key, entry)
                self._stats.num_blocks -= 1
                self._stats.num_bytes -= self._entry_bytes(entry)
                self._stats.deletes += 1

    def stats(self) -> StoreReport:
        with self._lock:
            report = self._stats.report()
            return dataclasses.replace(report, notes=report.notes | self._notes())

    def close(self) -> None:
        with self._lock:
            for key, entry in self._entries.items():
                self._release(key, entry)
            self._entries.clear()
            self._stats.num_blocks = self._stats.num_bytes = 0
