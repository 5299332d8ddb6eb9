"""Cross-replica invalidation: an eviction through one replica reaches every replica's tiers.

Evicting from Redis is not enough: every other replica may hold the prefix in its own device,
host or disk tier and would go on serving it. So an admin eviction is also published as an
``EvictionEvent`` -- the operator's selectors, not block lists -- on a Redis stream that every
replica follows (``tiers.redis_events``). Each replica applies the event to its local tiers
with its own tokenizer and clock (``CacheAdmin.apply_event``), within milliseconds: the reader
blocks on the stream and wakes when an event arrives.

Nothing is lost while a replica is away. A stream keeps its last events with increasing ids;
the reader remembers the id of the last event it handled (``cursor_path``, next to the disk
tier whose blocks outlive a restart), and after a reconnect or a restart it reads on from there.
If its id is older than the oldest event kept (it was away for longer than the stream
remembers), it cannot know what it missed and empties its local tiers. A replica without a
remembered id (first start, no disk tier: nothing survived) starts from the newest event.

A replica that cannot reach Redis keeps serving from its local tiers; it catches up when Redis
is back. Its own events are skipped (it evicted locally before publishing).

Anyone who can write Redis can write the stream. So every field of an entry is checked, and
each bounded like what a request may send (``EventBounds``: prefix text like a prompt), before
anything of it is tokenised or hashed; an entry that fails is counted, logged with the field
that was wrong (``MalformedEvent``) and skipped. What an entry costs a replica is then reading
it from Redis, and at most one prompt's tokenising and lookup.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol, TypeVar

from gateway.core.errors import MalformedEvent
from gateway.core.fingerprint import KEY_BYTES
from gateway.core.sessions import session_id_problem
from gateway.core.tags import tag_problem
from tiers.redis_events import REDIS_FAULTS, Event

logger = logging.getLogger(__name__)

T = TypeVar("T")


KEY_HEX_CHARS = 2 * KEY_BYTES
"""A block key in hex: what ``CacheAdmin.evict`` publishes (the whole key, never a beginning)."""

_KEY_HEX = re.compile(rf"[0-9a-f]{{{KEY_HEX_CHARS}}}")


@dataclass(frozen=True, slots=True, kw_only=True)
class EventBounds:
    """The most each free-text field of an event read from the stream may carry.

    NOTE: applying an event tokenises its prefix text and hashes the keys of its blocks, like
    serving a prompt of that text; bounded like a prompt (``max_prefix_chars`` is the served
    prompts' ``limits.max_prompt_chars``), an event costs a replica at most what one request
    does. A prefix over a replica's bound names nothing that replica holds: every prompt it
    cached was within the bound, and a prefix selects only when all of its blocks are cached.

    Attributes:
        max_prefix_chars: characters of ``prefix_text`` (``limits.max_prompt_chars``).
        max_tenant_chars: characters of ``tenant`` (a tenant id's bound).
        max_name_chars: characters of ``tier``, ``origin`` and ``older_than_s`` (what kvgate
            writes there is short: a tier's name, a replica's random id, a number).
    """

    max_prefix_chars: int
    max_tenant_chars: int
    max_name_chars: int = 64

    def __post_init__(self) -> None:
        if min(self.max_prefix_chars, self.max_tenant_chars, self.max_name_chars) < 1:
            raise ValueError("every bound of an event's fields must be >= 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class EvictionEvent:
    """What an operator evicted: the selectors of ``CacheAdmin.evict`` (all must match).

    Attributes:
        tenant: blocks of this tenant ("shared" for the shared scope).
        prefix_text: prompts beginning with this text, as warmed (``CacheAdmin.evict``).
        key_hex: one block and everything after it.
        older_than_s: blocks idle at least this long (on each replica's own clock).
        tier: only this tier's copies ("redis": no local copies at all).
        everything: every block.
        tag: blocks each replica tagged so in its own index, and what follows them
            (``gateway.cache.operations.tags``). A build without tags skips the whole event (an
            unknown field) rather than evict more than was asked.
        session: with ``tenant`` and nothing else: a session reset; each replica drops what
            the session owns there (``gateway.cache.operations.session_admin``). A build without
            sessions skips it (an unknown field), never evicts the whole tenant instead.
        origin: the replica that published it (its own events are skipped).
    """

    tenant: str | None = None
    prefix_text: str | None = None
    key_hex: str | None = None
    older_than_s: float | None = None
    tier: str | None = None
    everything: bool = False
    tag: str | None = None
    session: str | None = None
    origin: str = ""

    def to_fields(self) -> dict[str, str]:
        """The stream entry: only the selectors that are set."""
        out = {"kind": "evict", "origin": self.origin}
        for name in ("tenant", "prefix_text", "key_hex", "tier", "tag", "session"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.older_than_s is not None:
            out["older_than_s"] = repr(self.older_than_s)
        if self.everything:
            out["everything"] = "1"
        return out

    @classmethod
    def from_fields(cls, entry: Mapping[str, str], bounds: EventBounds) -> EvictionEvent:
        """The event of a stream entry.

        Anyone who can write Redis can write the stream, so every field is checked here, before
        anything is tokenised or hashed: its size against ``bounds``, its form (a key is a
        whole block key in hex, a flag is "1", an age a non-negative number, a tag and a session
        id follow their rules), and which fields go together (prefix text and a session name
        their tenant).

        Raises:
            MalformedEvent: not an eviction this build reads; the message names the field.
        """
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in entry.items()):
            raise MalformedEvent("a field's name or value is not text")
        if entry.get("kind") != "evict":
            raise MalformedEvent("its kind is not an eviction this build reads")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(entry) - known - {"kind"})
        if unknown:
            shown = ", ".join(repr(name[:32]) for name in unknown[:3])
            raise MalformedEvent(f"{len(unknown)} fields this build does not read ({shown})")
        _check_sizes(entry, bounds)
        key_hex = entry.get("key_hex")
        if key_hex is not None and not _KEY_HEX.fullmatch(key_hex):
            raise MalformedEvent(f"key_hex is not a block key ({KEY_HEX_CHARS} hex digits)")
        if entry.get("everything") not in (None, "1"):
            raise MalformedEvent('everything is not "1"')
        tag = entry.get("tag")
        if tag is not None and tag_problem(tag) is not None:
            raise MalformedEvent("tag is not a tag")
        if "prefix_text" in entry and "tenant" not in entry:
            raise MalformedEvent("prefix_text without the tenant it belongs to")
        session = entry.get("session")
        if session is not None:
            if session_id_problem(session) is not None:
                raise MalformedEvent("session is not a session id")
            if set(entry) - {"kind", "origin", "tenant", "session"} or "tenant" not in entry:
                # a reset names a tenant's session and nothing else
                raise MalformedEvent("a session reset with other selectors, or no tenant")
        try:
            older = entry.get("older_than_s")
            older_than_s = None if older is None else float(older)
        except ValueError:
            raise MalformedEvent("older_than_s is not a number") from None
        if older_than_s is not None and not (math.isfinite(older_than_s) and older_than_s >= 0):
            raise MalformedEvent("older_than_s is not a number of seconds >= 0")
        return cls(tenant=entry.get("tenant"), prefix_text=entry.get("prefix_text"),
                   key_hex=key_hex, older_than_s=older_than_s,
                   tier=entry.get("tier"), everything=entry.get("everything") == "1",
                   tag=tag, session=session, origin=entry.get("origin", ""))

    def with_origin(self, origin: str) -> EvictionEvent:
        return EvictionEvent(tenant=self.tenant, prefix_text=self.prefix_text,
                             key_hex=self.key_hex, older_than_s=self.older_than_s,
                             tier=self.tier, everything=self.everything, tag=self.tag,
                             session=self.session, origin=origin)


class EventLog(Protocol):
    """The shared stream (``tiers.redis_events.RedisEventLog``)."""

    where: str

    def append(self, fields: Mapping[str, str]) -> str: ...

    def last_id(self) -> str: ...

    def first_id(self) -> str | None: ...

    def read_after(self, cursor: str, *, count: int = 100) -> list[Event]: ...

    def close(self) -> None: ...


class EvictionFeed:
    """Publishes this replica's evictions and applies everyone else's (module docstring).

    Args:
        log: the shared stream.
        apply: applies an event to the local tiers (``CacheAdmin.apply_event``).
        origin: this replica's id (random per process).
        bounds: the most an event's fields may carry; an event over them is malformed, skipped
            before anything of it is tokenised.
        cursor_path: where the id of the last handled event is kept (None: not kept).
        retry_s: how long to wait after a Redis fault before reading again.
    """

    def __init__(self, log: EventLog, apply: Callable[[EvictionEvent], None], *, origin: str,
                 bounds: EventBounds, cursor_path: Path | None = None,
                 retry_s: float = 1.0) -> None:
        self._log = log
        self._apply = apply
        self.origin = origin
        self._bounds = bounds
        self._cursor_path = cursor_path
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._is_in_outage = False
        self.num_applied = 0
        self.num_malformed = 0
        """Events skipped because this build could not read them (malformed, or a newer kind)."""
        self.num_failed = 0
        """Events skipped because applying them raised (the reader goes on with the next)."""
        self.caught_up = threading.Event()
        """Set once the reader has handled every event published before it started."""
        self.settled = threading.Event()
        """Set once it caught up, or found the stream unreachable (the replica then serves
        from its local tiers and catches up when Redis is back)."""
        self._clock = time.monotonic
        self.last_read_at: float | None = None
        """When the reader last read the stream (``time.monotonic``; None: never yet)."""

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvgate-evictions", daemon=True)
        self._thread.start()

    @property
    def is_reading(self) -> bool:
        """Whether the reader runs (from ``start`` until ``stop``; nothing an event carries
        ends it)."""
        return self._thread is not None and self._thread.is_alive()

    def behind_reason(self, max_quiet_s: float) -> str | None:
        """Why this replica may be missing other replicas' evictions, or None: the reader is
        not running, or has not read the stream for ``max_quiet_s`` (Redis unreachable)."""
        if not self.is_reading:
            return "the eviction reader is not running"
        if self.last_read_at is None:
            # Reached at start (a cursor was read): not behind until it goes quiet.
            return None if self.caught_up.is_set() else "the eviction stream has not been " \
                "read yet"
        quiet = self._clock() - self.last_read_at
        if quiet > max_quiet_s:
            return f"the eviction stream has not been read for {quiet:.0f} s"
        return None

    def stop(self) -> None:
        """Stop reading (before the stores close); waits at most one blocking read."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._log.close()

    def publish(self, event: EvictionEvent) -> bool:
        """Tell the other replicas; False if the stream could not be reached."""
        try:
            self._log.append(event.with_origin(self.origin).to_fields())
        except REDIS_FAULTS as exc:
            logger.warning("an eviction could not be published to the other replicas through "
                           "%s: %s", self._log.where, type(exc).__name__)
            return False
        return True

    # ---- the reader -----------------------------------------------------------------------

    def _run(self) -> None:
        cursor = None
        while cursor is None and not self._stop.is_set():
            cursor = self._attempt(self._start_cursor)
            if cursor is None:
                self.settled.set()  # unreachable: do not hold the replica back for it
                self._stop.wait(self._retry_s)
        if cursor is not None and (self._cursor_path is None
                                   or not self._cursor_path.exists()):
            self._save(cursor)  # a restart reads on from here
            self.caught_up.set()  # it starts from the newest event: nothing to catch up on
            self.settled.set()
        while cursor is not None and not self._stop.is_set():
            after: str = cursor
            events = self._attempt(lambda: self._log.read_after(after))  # noqa: B023
            if events is not None:
                self.last_read_at = self._clock()
            if events is None:
                self.settled.set()
                self._stop.wait(self._retry_s)
                continue
            for event_id, entry in events:
                self._handle(event_id, entry)
                cursor = event_id  # handled or skipped: never read again
            if events:
                self._save(cursor)
            else:
                self.caught_up.set()
                self.settled.set()

    def _handle(self, event_id: str, entry: Mapping[str, str]) -> None:
        """Apply one event; one that cannot be read or applied is counted and skipped.

        NOTE: anyone who can write Redis can write the stream, and one event that raised
        would end the reader: this replica would never hear of another eviction. So nothing
        an event does escapes here. The log names the event's id, the field that was wrong and
        the error's type only: an event's fields (prefix text) and an error's message may carry
        prompt text.
        """
        try:
            event = EvictionEvent.from_fields(entry, self._bounds)
        except MalformedEvent as exc:
            logger.warning("skipping event %s on %s: not an eviction this build reads: %s "
                           "(written by a newer kvgate, or by someone else who can write "
                           "Redis: check its ACL)", event_id, self._log.where, exc)
            self.num_malformed += 1
            return
        except Exception as exc:  # whatever it is, the reader goes on (NOTE)
            logger.warning("skipping event %s on %s: cannot read it (%s)", event_id,
                           self._log.where, type(exc).__name__)
            self.num_malformed += 1
            return
        if event.origin == self.origin:
            return
        if self._apply_guarded(event, event_id):
            self.num_applied += 1

    def _apply_guarded(self, event: EvictionEvent, event_id: str) -> bool:
        """``apply(event)``; False (counted, logged) if it raised."""
        try:
            self._apply(event)
        except Exception as exc:  # the reader goes on (_handle's NOTE)
            logger.warning("skipping event %s on %s: applying it failed (%s)", event_id,
                           self._log.where, type(exc).__name__)
            self.num_failed += 1
            return False
        return True

    def _start_cursor(self) -> str:
        saved = self._load()
        if saved is None:
            return self._log.last_id()
        first = self._log.first_id()
        if first is not None and _id_key(saved) < _id_key(first) and saved != "0-0":
            logger.warning("missed evictions while away (the event stream on %s no longer goes "
                           "back to %s): dropping every local block", self._log.where, saved)
            self._apply_guarded(EvictionEvent(everything=True, origin="gap"), saved)
        return saved

    def _attempt(self, call: Callable[[], T]) -> T | None:
        try:
            result = call()
        except REDIS_FAULTS as exc:
            if not self._is_in_outage:
                self._is_in_outage = True
                logger.warning("cannot read evictions from %s (%s): local tiers keep serving; "
                               "retrying every %.1f s", self._log.where, type(exc).__name__,
                               self._retry_s)
            return None
        if self._is_in_outage:
            self._is_in_outage = False
            logger.info("reading evictions from %s again", self._log.where)
        return result

    def _load(self) -> str | None:
        if self._cursor_path is None:
            return None
        try:
            text = self._cursor_path.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        try:
            _id_key(text)
        except ValueError:
            return None
        return text

    def _save(self, cursor: str) -> None:
        if self._cursor_path is None:
            return
        temp = self._cursor_path.with_name(self._cursor_path.name + ".tmp")
        try:
            temp.write_text(cursor, encoding="ascii")
            os.replace(temp, self._cursor_path)
        except OSError as exc:
            logger.warning("cannot keep the eviction cursor in %s: %s", self._cursor_path,
                           exc.strerror)


def _check_sizes(entry: Mapping[str, str], bounds: EventBounds) -> None:
    """Refuse a free-text field over its bound (``EventBounds``); says which and by how much.

    Raises:
        MalformedEvent: a field over its bound, or an empty tenant.
    """
    for name, most in (("prefix_text", bounds.max_prefix_chars),
                       ("tenant", bounds.max_tenant_chars),
                       ("tier", bounds.max_name_chars), ("origin", bounds.max_name_chars),
                       ("older_than_s", bounds.max_name_chars)):
        value = entry.get(name)
        if value is not None and len(value) > most:
            raise MalformedEvent(f"{name} has {len(value)} characters, more than {most}")
    if entry.get("tenant") == "":
        raise MalformedEvent("tenant is empty")


def _id_key(event_id: str) -> tuple[int, int]:
    """A stream id ``"<ms>-<seq>"`` as a sortable pair.

    Raises:
        ValueError: not a stream id.
    """
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq or 0)
