"""The scheduler's view of which blocks the worker's kvgate cache can load.

Why a view, not the cache: vLLM asks "how many of this prompt's tokens can you load" in its
scheduler process, and the cache lives in the worker process (docs/vllm-worker.md, "How it
works"). So the scheduler answers from what it can see without the worker: the keys the
worker reported storing (a step late), and the disk tier's files, whose names are their keys
(``tiers.disk_layout``) -- so after a restart the first request already finds what the last run
left on disk. A file is not verified here: a stale or forged one is found out by the worker,
whose load then falls short; the short blocks are reported, vLLM recomputes them, and their
keys leave the view (``forget``). Past what it knows locally it asks Redis, where replicas
share blocks (``remote_keys``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from gateway.vllm_connector.remote_keys import RedisKeyProbe
from policies.base import BlockKey
from tiers.disk_layout import ShardLayout
from tiers.fileops import RealFileOps

MAX_REMEMBERED = 1 << 20
"""Keys remembered from the worker's reports at most (the oldest are forgotten first): ~100 MB
of a Python set at most, and a forgotten key that is still cached costs one recompute."""


class KnownKeys:
    """Keys the worker reported, and the disk tiers' files.

    Args:
        disk_roots: the worker's disk tiers' directories (read, never written).
        remote: asks the worker's Redis tier, if it has one.
        max_remembered: keys remembered from reports at most.
    """

    def __init__(self, *, disk_roots: Sequence[Path] = (), remote: RedisKeyProbe | None = None,
                 max_remembered: int = MAX_REMEMBERED) -> None:
        if max_remembered < 1:
            raise ValueError(f"max_remembered must be >= 1, got {max_remembered}")
        self._remembered: dict[BlockKey, None] = {}  # insertion-ordered: oldest first
        self._refused: dict[BlockKey, None] = {}  # found wanting: their files are not believed
        self._max = max_remembered
        self._remote = remote
        ops = RealFileOps()
        self._disks = [ShardLayout(str(root), ops, fsync=False) for root in disk_roots]

    def __len__(self) -> int:
        return len(self._remembered)

    def count_leading(self, keys: Sequence[BlockKey], *, namespace_digest: bytes | None = None
                      ) -> int:
        """How many of ``keys``, from the first, the worker's cache is believed to hold
        (Redis is asked past the local ones where ``namespace_digest`` is given)."""
        index = next((i for i, key in enumerate(keys) if not self._believed(key)), len(keys))
        if (index == len(keys) or self._remote is None or namespace_digest is None
                or keys[index] in self._refused):
            return index
        return index + self._remote.count_leading(namespace_digest, keys[index:])

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()

    def remember(self, keys: Iterable[BlockKey]) -> None:
        """The worker holds ``keys`` now."""
        for key in keys:
            self._remembered.pop(key, None)
            self._refused.pop(key, None)
            self._remembered[key] = None
        _bound(self._remembered, self._max)

    def forget(self, keys: Iterable[BlockKey]) -> None:
        """The worker found ``keys`` missing or unverifiable: not believed again, their files
        included, until the worker reports storing them."""
        for key in keys:
            self._remembered.pop(key, None)
            self._refused[key] = None
        _bound(self._refused, self._max)

    def _believed(self, key: BlockKey) -> bool:
        return key in self._remembered or (key not in self._refused and self._on_disk(key))

    def _on_disk(self, key: BlockKey) -> bool:
        return any(os.path.exists(disk.path_for(key)) for disk in self._disks)


def _bound(keys: dict[BlockKey, None], limit: int) -> None:
    while len(keys) > limit:
        del keys[next(iter(keys))]
