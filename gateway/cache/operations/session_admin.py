"""Sessions for operators, and their end: list, reset (every tier, every replica), expire.

What a session owns is decided by ``gateway.cache.sessions`` (its ownership rule). This module
drops it -- on a reset (``kvgate admin sessions reset``) and when the session has been idle for
``[cache] session_ttl_s`` -- from every local tier, from Redis, and from the engine's
conversation tails, so that the session's next request starts cold; a shared prefix it read
(a system prompt warmed by others, blocks another session used too) stays.

Redis keeps no sessions, so the Redis copies of the session's blocks are removed by key, as an
eviction by tag removes its blocks' copies (``gateway.cache.operations.remote_eviction``) --
of the blocks this replica stored only (``is_stored_here``). Other replicas hear a reset through the
eviction stream (``EvictionEvent`` with ``tenant`` and ``session``); each drops what the session
owns
*there*, and the Redis copies of what it stored, since the replica that stored a block is the
one that knows whose it is. An expiry is each replica's own: it is not published (a session
that moved to another replica lives on there).
"""

from __future__ import annotations

import logging
from typing import Protocol

from gateway.cache.lossy_copies import lossy_copies
from gateway.cache.operations.invalidation import EvictionEvent
from gateway.cache.prefix_cache import PrefixCache
from gateway.cache.sessions import is_stored_here
from gateway.core.admin_reports import SessionInfo, SessionReset
from gateway.core.errors import EvictionNotPublished, InvalidRequest, NotFound
from gateway.core.sessions import checked_session_id

logger = logging.getLogger(__name__)


class Publisher(Protocol):
    """Tells the other replicas (``gateway.cache.operations.invalidation.EvictionFeed``)."""

    def publish(self, event: EvictionEvent) -> bool:
        """False if they could not be told."""
        ...


def drop_session(cache: PrefixCache, owner: str, session_id: str, *,
                 reason: str = "admin") -> SessionReset:
    """Drop what ``owner``'s session ``session_id`` owns on this replica -- its blocks
    (``SessionRegistry.blocks_to_drop``) from every local tier and the Redis copies of those it
    stored here, and its conversation tails -- and forget the session. Blocks a running request
    reads stay, as with every eviction. ``reason`` is what the tiers count the evictions as
    ("admin" or "ttl")."""
    placement = cache.placement
    registry = cache.sessions
    transfers = cache.transfers
    with placement.locked():
        mine = registry.blocks_to_drop(owner, session_id)
        # The lossy copies the cache wrote through for the session's exact blocks go with them.
        copies = lossy_copies(cache, [r for r in mine if is_stored_here(r)])
    if transfers is not None and transfers.has_remote:
        # Redis first, so that nothing is fetched back from it once the local copies are gone.
        keys = [(r.namespace.digest, r.key) for r in mine if is_stored_here(r)]
        keys += [(ns.digest, key) for ns, key in copies if transfers.remote_holds(ns)]
        for digest, key in keys:
            transfers.remove_remote_where(namespace_digest=digest, key=key)
    freed: dict[str, int] = {}
    with placement.locked():
        index = placement.index
        before = len(index)
        copied = [record for ns, key in copies
                  if (record := index.get(key)) is not None and record.namespace == ns]
        # Deepest first, so that children leave before their parents.
        for record in sorted([*registry.blocks_to_drop(owner, session_id), *copied],
                             key=lambda r: r.depth, reverse=True):
            if record.key not in index or record.refcount:
                continue
            for name in cache.tier_names:
                if placement.may_leave(record, name):
                    placement.evict_copy(record, name, reason)
                    freed[name] = freed.get(name, 0) + record.num_bytes
            placement.drop_unheld([record])
        num_blocks = before - len(index)
        moves = placement.take_moves()
    cache.run_moves(moves)  # the deletions, after the lock
    cache.keep_pins()  # a pin went with its block's last copy: the pin log forgets it
    tails = registry.tails
    tail_bytes = tails.drop_session(owner, session_id) if tails is not None else 0
    registry.forget(owner, session_id)
    return SessionReset(tenant=owner, num_blocks=num_blocks, bytes_by_tier=freed,
                        tail_bytes=tail_bytes)


def drop_expired_sessions(cache: PrefixCache) -> int:
    """Drop every session idle for its TTL, or pushed out by its tenant's limit; how many
    (the sweeper calls it, ``gateway.cache.operations.sweeper``)."""
    due = cache.sessions.take_due()
    for owner, session_id in due:
        drop_session(cache, owner, session_id, reason="ttl")
    return len(due)


class SessionAdmin:
    """The Admin service's session operations on one cache.

    Args:
        cache: the cache whose sessions these are.
        feed: where resets are published for the other replicas (None: a lone replica).
    """

    def __init__(self, cache: PrefixCache, *, feed: Publisher | None = None) -> None:
        self._cache = cache
        self._feed = feed

    def list(self, *, tenant: str | None = None, limit: int = 100) -> list[SessionInfo]:
        """The sessions this replica knows (of ``tenant``, or all), most recently used first."""
        registry = self._cache.sessions
        entries = registry.entries(tenant)[:limit]
        with self._cache.placement.locked():
            totals = [registry.totals(e.owner, e.session_id) for e in entries]
        now, ttl, tails = registry.now(), registry.limits.ttl_s, registry.tails
        out = []
        for entry, (num_blocks, num_bytes) in zip(entries, totals, strict=True):
            tail_tokens, tail_bytes = ((0, 0) if tails is None
                                       else tails.session_tail(entry.owner, entry.session_id))
            idle = max(0.0, now - entry.last_used)
            out.append(SessionInfo(
                tenant=entry.owner, session_id=entry.session_id, num_blocks=num_blocks,
                num_bytes=num_bytes + tail_bytes, tail_tokens=tail_tokens, idle_s=idle,
                expires_in_s=max(0.0, ttl - idle)))
        return out

    def reset(self, session_id: str, *, tenant: str | None = None) -> SessionReset:
        """Drop ``tenant``'s session ``session_id`` here, in Redis and on every other replica
        (published); its next request starts cold. Without ``tenant``: the one tenant this
        replica knows a session of that id of.

        Raises:
            InvalidRequest: not a session id, or several tenants have a session of that id.
            NotFound: this replica knows no such session of ``tenant`` (the same answer whether
                or not another tenant has one of that id).
            EvictionNotPublished: dropped here and from Redis, but the other replicas could not
                be told (retry: a reset is idempotent).
        """
        checked_session_id(session_id)
        owner = self._owner_of(session_id, tenant)
        dropped = drop_session(self._cache, owner, session_id, reason="admin")
        if self._feed is not None and not self._feed.publish(
                EvictionEvent(tenant=owner, session=session_id)):
            raise EvictionNotPublished(
                f"session {session_id!r} was dropped here ({dropped.num_blocks} blocks) and "
                "from Redis, but the other replicas could not be told: Redis is unreachable; "
                "retry the reset")
        return dropped

    def apply_event(self, event: EvictionEvent) -> None:
        """Apply a reset another replica published: drop what the session owns here."""
        if event.tenant is None or event.session is None:
            return
        dropped = drop_session(self._cache, event.tenant, event.session, reason="admin")
        logger.info("applied a session reset from another replica: %d blocks, %d bytes freed",
                    dropped.num_blocks,
                    sum(dropped.bytes_by_tier.values()) + dropped.tail_bytes)

    def _owner_of(self, session_id: str, tenant: str | None) -> str:
        registry = self._cache.sessions
        if tenant is not None:
            if registry.get(tenant, session_id) is None:
                raise NotFound(_unknown(session_id, tenant))
            return tenant
        owners = sorted({e.owner for e in registry.entries() if e.session_id == session_id})
        if not owners:
            raise NotFound(_unknown(session_id, None))
        if len(owners) > 1:
            raise InvalidRequest(f"session {session_id!r} is ambiguous: tenants {owners} each "
                                 "have a session of that id; name the tenant")
        return owners[0]


def _unknown(session_id: str, tenant: str | None) -> str:
    """The one answer for a session this replica does not know, whoever else has that id."""
    whose = f" of tenant {tenant!r}" if tenant is not None else ""
    return (f"no session {session_id!r}{whose} on this replica: it expired or was reset, or "
            "this replica served none of its requests (`kvgate admin sessions ls` lists the "
            "sessions a replica knows)")
