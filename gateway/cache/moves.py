"""The byte moves placement decides under the cache's lock and the transfers carry out after it.

``TierPlacement`` decides who holds what without touching a store; each of its decisions that
concerns bytes -- copy an evicted block into the tier below (a demotion), delete a copy, write a
new or promoted block -- becomes one ``ByteMove``, queued in the order decided (a victim's copy
comes after the moves that made room for it below, and before its deletion above). The caller
takes the queue before it lets go of the lock; ``TierTransfers.run`` carries the moves out after
and posts what became of them (``MoveOutcomes``), which placement settles at its next stay under
the lock. A step is a record: neither side calls the other back.

Until a move is settled, the (block, tier) it touches is *moving*: placement neither reads nor
places a copy there, so a reader never finds a copy whose bytes have not landed, and a deletion
never removes bytes placed again meanwhile.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.cache.radix_index import BlockRecord
from policies.base import BlockKey
from tiers.base import BlockMeta
from tiers.payload import KVBlock


@dataclass(frozen=True, slots=True, kw_only=True)
class ByteMove:
    """One step for a block's bytes, decided under the lock and carried out after it.

    Attributes:
        key: the block.
        tier: where its bytes go (a copy or a write) or leave (a delete).
        record: a copy's or write's block, holding one reference until settled; None for a
            delete.
        meta: its identity in the stores (None for a delete).
        source: a copy (a demotion): the tier its bytes are read from.
        block: a write: the payload.
    """

    key: BlockKey
    tier: str
    record: BlockRecord | None = None
    meta: BlockMeta | None = None
    source: str | None = None
    block: KVBlock | None = None

    @property
    def is_delete(self) -> bool:
        """Whether the step deletes ``key``'s bytes from ``tier``."""
        return self.record is None


class MoveQueue:
    """The moves decided and not taken yet, and the (block, tier) pairs not settled yet.

    Not thread-safe: it lives under the placement's lock.
    """

    def __init__(self) -> None:
        self._moves: list[ByteMove] = []
        self._slot_to_num_moving: dict[tuple[BlockKey, str], int] = {}

    def __len__(self) -> int:
        """Moves queued or taken and not settled."""
        return sum(self._slot_to_num_moving.values())

    def __bool__(self) -> bool:
        """Whether any move is not settled (cheaper than ``len``)."""
        return bool(self._slot_to_num_moving)

    def push(self, move: ByteMove) -> None:
        """Queue ``move``; its (block, tier) is moving from now until ``settled``."""
        slot = (move.key, move.tier)
        self._slot_to_num_moving[slot] = self._slot_to_num_moving.get(slot, 0) + 1
        self._moves.append(move)

    def take(self) -> list[ByteMove]:
        """The moves queued since the last call, in order."""
        moves, self._moves = self._moves, []
        return moves

    def is_moving(self, key: BlockKey, tier: str) -> bool:
        """Whether a move of ``key``'s bytes in ``tier`` is not settled yet."""
        return (key, tier) in self._slot_to_num_moving

    def settled(self, move: ByteMove) -> None:
        """``move`` is over (done or not): its (block, tier) moves no more on its account."""
        slot = (move.key, move.tier)
        left = self._slot_to_num_moving[slot] - 1
        if left:
            self._slot_to_num_moving[slot] = left
        else:
            del self._slot_to_num_moving[slot]


class MoveOutcomes:
    """The moves the transfers carried out (or could not), waiting for placement's next stay.

    The transfers post here after the bytes have landed, with no lock held and without
    calling placement; placement settles what is posted first thing whenever it takes its
    lock (``TierPlacement.locked``). Until then the move's block keeps its reference and its
    new copy is not read, as before any move settles: nothing can see the difference, since
    everything that reads or changes who holds what takes the lock first. (SGLang's scheduler
    takes its cache controller's finished loads the same way, at its next step.) Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted: list[tuple[ByteMove, bool]] = []

    def post(self, moves: Sequence[ByteMove], done: Sequence[bool]) -> None:
        """``moves`` were carried out, in order: ``done[i]`` says whether the i-th was (a move
        after the last of ``done``, cut short by an error, was not)."""
        with self._lock:
            self._posted.extend(
                (move, i < len(done) and done[i]) for i, move in enumerate(moves))

    def take(self) -> list[tuple[ByteMove, bool]]:
        """What was posted since the last call, in order."""
        with self._lock:
            posted, self._posted = self._posted, []
        return posted

    def __bool__(self) -> bool:
        return bool(self._posted)
