"""Sessions: which cached blocks belong to one conversation, and when it was last used.

A request may name its session (``gateway.core.sessions``). The engine tells the registry what
each request used (``note_use``: the blocks it found cached, at admission) and stored
(``note_stored``), and the registry keeps, on each ``BlockRecord``, whose block it is:

    the ownership rule: a block belongs to session S of tenant T while S's requests are the
    only requests on this replica that have stored or read it. The first request to store or
    read a block claims it (for its session, or for nobody when it has none); any request of
    another session, or one without a session (Warm included), makes it common for good.

So a system prompt warmed by ``kvgate prewarm``, stored by requests without a session, or read
by a second session is never a session's, and resetting or expiring a session can never drop
another session's or another tenant's prefix (tenants are apart anyway: a tenant's blocks are
in its own namespace). What is a session's is its own conversation: the blocks after the part
it shares, and its conversation tail (``SessionTails``, the engine's tail cache).

It is one replica's knowledge, as tags are (``gateway.cache.operations.tags``): kept in the
radix index, not in the disk tier's headers or Redis. So a claim also says where the block came
from. A block a session's request stored here, or read first from a local tier (adopted from this
replica's own disk after a restart), is *stored here* (``record.session == S``): dropping the
session removes its Redis copy too. A block it read first from Redis is only *read here* (``READ +
S``): this replica drops its own copies and leaves the Redis copy to the replica that stored it --
which drops it when the reset reaches it, if it was that session's there too, and keeps it (a system
prompt another replica warmed) if not.

The registry also remembers when each session was last used (the cache's clock), so that a
session expires ``SessionLimits.ttl_s`` after its last request, and keeps at most
``max_per_tenant`` sessions of a tenant (past that, its least recently used one expires at the
next sweep): session ids come from clients, and the table must stay bounded whatever they send.
Dropping a session's blocks and tail is ``gateway.cache.operations.session_admin``.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.cache.config import DEFAULT_MAX_SESSIONS_PER_TENANT, DEFAULT_SESSION_TTL_S
from gateway.cache.placement import TierPlacement
from gateway.cache.radix_index import BlockRecord
from gateway.core.fingerprint import Namespace
from policies.base import BlockKey
from tiers.hierarchy import REMOTE

COMMON = ""
"""``BlockRecord.session`` of a block more than one party used (never a valid session id)."""

READ = "~"
"""``BlockRecord.session`` is ``READ + S`` for a block session S read from Redis and nobody else
used here (``~`` is never in a session id)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionLimits:
    """How long a session lives without a request, and how many a tenant may have at once.

    Attributes:
        ttl_s: seconds after a session's last request when its blocks and tail are dropped.
        max_per_tenant: sessions one tenant may have on this replica; one more expires the
            tenant's least recently used session at the next sweep.
    """

    ttl_s: float = DEFAULT_SESSION_TTL_S
    max_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttl_s) and self.ttl_s > 0):
            raise ValueError(f"a session's ttl_s must be a positive number of seconds, got "
                             f"{self.ttl_s!r}")
        if self.max_per_tenant < 1:
            raise ValueError(f"max_per_tenant must be >= 1, got {self.max_per_tenant!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionEntry:
    """One session the registry knows: whose, which, and when its last request came."""

    owner: str
    session_id: str
    last_used: float


class SessionTails(Protocol):
    """The conversation tails sessions kept (``gateway.engine.kv.tail_cache.TailCache``)."""

    def session_tail(self, owner: str, session_id: str) -> tuple[int, int]:
        """Tokens and bytes of the tails only this session kept and used."""
        ...

    def drop_session(self, owner: str, session_id: str) -> int:
        """Drop those tails; the bytes they held."""
        ...


def claim(record: BlockRecord, session_id: str | None, *, from_remote: bool = False) -> bool:
    """A request of ``session_id`` (None: of no session) stored or read ``record``, which it
    read from Redis if ``from_remote`` (module docstring: the ownership rule); whether that
    made the block the session's. Hold the placement lock."""
    user = COMMON if session_id is None else session_id
    if record.session is None:
        record.session = (READ + user) if from_remote and user else user
        return bool(user)
    if record.session.removeprefix(READ) != user:
        record.session = COMMON
    return False


def session_of(record: BlockRecord) -> str | None:
    """The session ``record`` belongs to (stored or only read here), or None."""
    if not record.session:
        return None
    return record.session.removeprefix(READ)


def is_stored_here(record: BlockRecord) -> bool:
    """Whether this replica stored ``record`` (its Redis copy is this replica's to remove):
    not a block a session only read here from Redis."""
    return not (record.session or "").startswith(READ)


class SessionRegistry:
    """Marks whose blocks are whose, and remembers when each session was last used.

    Args:
        placement: the cache's placement (its lock, index and clock).
        limits: the sessions' lifetime and how many a tenant may have.
    """

    def __init__(self, placement: TierPlacement, limits: SessionLimits) -> None:
        self._placement = placement
        self.limits = limits
        self._lock = threading.Lock()  # the table: the engine writes, admin and sweeper read
        self._by_owner: dict[str, OrderedDict[str, float]] = {}  # least recently used first
        self._over: list[tuple[str, str]] = []  # pushed out by max_per_tenant, to drop
        # The keys of the blocks each (owner, session) claimed, so that finding a session's
        # blocks never walks the whole index; under the placement lock. A key whose block left,
        # or became common, is skipped when read and goes with the session.
        self._claimed: dict[tuple[str, str], set[BlockKey]] = {}
        self.tails: SessionTails | None = None
        """Where sessions' conversation tails are kept (attached by the engine; None: none)."""

    def attach_tails(self, tails: SessionTails | None) -> None:
        """Tell the registry where the engine keeps conversation tails."""
        self.tails = tails

    # ---- the request path -------------------------------------------------------------

    def note_use(self, namespace: Namespace, session_id: str | None,
                 records: Sequence[BlockRecord], tiers: Sequence[str] = ()) -> None:
        """A request (of ``session_id``, or of none) found ``records`` cached in ``namespace``,
        each in the tier ``tiers`` names at its position (``REMOTE``: read from Redis)."""
        with self._placement.locked():
            for i, record in enumerate(records):
                self._claim(record, session_id, i < len(tiers) and tiers[i] == REMOTE)
        if session_id is not None:
            self._touch(namespace.scope.owner, session_id)

    def note_stored(self, namespace: Namespace, session_id: str | None,
                    keys: Iterable[BlockKey]) -> None:
        """A request (of ``session_id``, or of none) stored the blocks ``keys`` of
        ``namespace`` (those that are cached now; a block refused by a tier is not)."""
        placement = self._placement
        with placement.locked():
            index = placement.index
            for key in keys:
                record = index.get(key)
                if record is not None and record.namespace == namespace:
                    self._claim(record, session_id, False)
        if session_id is not None:
            self._touch(namespace.scope.owner, session_id)

    def touch(self, namespace: Namespace, session_id: str | None) -> None:
        """A request of ``session_id`` (None: of no session) in ``namespace`` is still running:
        its session is in use now."""
        if session_id is not None:
            self._touch(namespace.scope.owner, session_id)

    def _claim(self, record: BlockRecord, session_id: str | None, from_remote: bool) -> None:
        if claim(record, session_id, from_remote=from_remote) and session_id is not None:
            owner = record.namespace.scope.owner
            self._claimed.setdefault((owner, session_id), set()).add(record.key)

    def _touch(self, owner: str, session_id: str) -> None:
        now = self._placement.now()
        with self._lock:
            sessions = self._by_owner.setdefault(owner, OrderedDict())
            sessions[session_id] = now
            sessions.move_to_end(session_id)
            while len(sessions) > self.limits.max_per_tenant:
                oldest, _ = sessions.popitem(last=False)
                self._over.append((owner, oldest))

    # ---- a session's blocks (hold the placement lock) -----------------------------------

    def owned(self, owner: str, session_id: str) -> list[BlockRecord]:
        """The blocks ``owner``'s session ``session_id`` owns here, shallowest first.

        A pinned block is never a session's: the pin is the operator's word that it stays. (A
        pinned system prompt adopted from disk after a restart is claimed by whichever request
        reads it first, a session's included; its reset would otherwise take the pin with it.)
        """
        index = self._placement.index
        records = [record for key in self._claimed.get((owner, session_id), ())
                   if (record := index.get(key)) is not None
                   and not record.is_pinned
                   and session_of(record) == session_id
                   and record.namespace.scope.owner == owner
                   and record.namespace.scope.kind == "tenant"]
        records.sort(key=lambda r: r.depth)
        return records

    def blocks_to_drop(self, owner: str, session_id: str) -> list[BlockRecord]:
        """What dropping the session drops: its blocks, and the blocks after them nobody has
        used since they were indexed (a block is only useful with its ancestors). Blocks after
        them that another party used are left out, and keep those ancestors in turn."""
        mine = (session_id, READ + session_id, None)
        selected: dict[int, BlockRecord] = {}
        for record in self.owned(owner, session_id):
            if id(record) in selected:
                continue
            for block in self._placement.index.subtree(record.namespace, record):
                if block.session in mine and not block.is_pinned:
                    selected.setdefault(id(block), block)
        return list(selected.values())

    def totals(self, owner: str, session_id: str) -> tuple[int, int]:
        """Blocks and bytes the session owns here."""
        records = self.owned(owner, session_id)
        return len(records), sum(r.num_bytes for r in records)

    # ---- the table --------------------------------------------------------------------

    def now(self) -> float:
        """The cache's clock."""
        return self._placement.now()

    def get(self, owner: str, session_id: str) -> SessionEntry | None:
        """``owner``'s session ``session_id``, if this replica knows it."""
        with self._lock:
            sessions = self._by_owner.get(owner)
            last = None if sessions is None else sessions.get(session_id)
        if last is None:
            return None
        return SessionEntry(owner=owner, session_id=session_id, last_used=last)

    def entries(self, owner: str | None = None) -> list[SessionEntry]:
        """The sessions this replica knows (of ``owner`` only, if given), most recently used
        first."""
        with self._lock:
            out = [SessionEntry(owner=who, session_id=sid, last_used=last)
                   for who, sessions in self._by_owner.items()
                   if owner is None or who == owner
                   for sid, last in sessions.items()]
        out.sort(key=lambda entry: entry.last_used, reverse=True)
        return out

    def forget(self, owner: str, session_id: str) -> None:
        """Drop ``owner``'s session ``session_id`` from the table (its blocks are dropped by
        the caller)."""
        with self._placement.locked():
            self._claimed.pop((owner, session_id), None)
        with self._lock:
            sessions = self._by_owner.get(owner)
            if sessions is not None:
                sessions.pop(session_id, None)
                if not sessions:
                    del self._by_owner[owner]

    def take_due(self) -> list[tuple[str, str]]:
        """Take the sessions whose time is up: idle for ``ttl_s``, or pushed out by
        ``max_per_tenant`` (and not used again since)."""
        now = self._placement.now()
        ttl = self.limits.ttl_s
        with self._lock:
            due = [(owner, sid) for owner, sid in self._over
                   if sid not in self._by_owner.get(owner, {})]
            self._over.clear()
            for owner in list(self._by_owner):
                sessions = self._by_owner[owner]
                while sessions:
                    sid, last = next(iter(sessions.items()))
                    if last + ttl > now:
                        break
                    sessions.popitem(last=False)
                    due.append((owner, sid))
                if not sessions:
                    del self._by_owner[owner]
        return due
