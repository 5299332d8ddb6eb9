"""The HTTP front's connections, below the application: deadlines and caps uvicorn lacks.

uvicorn bounds connections only by ``limit_concurrency``, which counts them and answers 503 to
*requests* once it is reached, and runs no timer before a connection's first request. So
connections that never send a byte locked every keyed request and ``/health`` out, were never
closed, and took the process's file descriptors -- the gRPC front's included (issue 22).

``GuardedH11Protocol`` is uvicorn's h11 protocol that reports to one ``ConnectionGuard`` per
front. A connection is in one of three states:

    waiting    connected, or done with its last answer (a kept-alive one), and no whole request
               head yet: nothing is known about it, not even a key. Closed ``header_timeout_s``
               after it began waiting (data that trickles in does not reset the clock); at most
               ``max_waiting`` wait at once, one more closes the one that has waited longest.
    receiving  a head arrived and the application is answering, but the body is not all in.
               The application answers 408 ``body_timeout_s`` after it began reading; the
               connection is closed ``BODY_GRACE_S`` later if it is still receiving (a route
               that does not read its body, a future one that forgets the deadline).
    answering  the whole request is in: bounded by the engine's deadline, not here.

At most ``max_connections`` are open: one more closes the one that has waited longest, or
itself when every connection has a request in flight. No request is ever refused for the
number of connections, so idle clients cannot lock keyed ones out; and ``limits_within`` keeps
``max_connections`` under half the process's open-file limit, so they cannot exhaust it either.

A connection whose first bytes are HTTP/2's preface is a gRPC client on the wrong port: it is
answered by ``grpc_refusal`` (a gRPC status naming the right port) instead of h11, and closed.

NOTE: with TLS, the event loop calls ``connection_made`` after the handshake; until then a
connection is asyncio's (its own handshake timeout, 60 s) and not counted here.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any, Literal

from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle
from uvicorn.server import ServerState

from gateway.config.settings import HttpSettings
from gateway.service.http.grpc_refusal import (
    PREFACE,
    GrpcRefusal,
    might_be_preface,
    refusal_message,
)

logger = logging.getLogger(__name__)

BODY_GRACE_S = 1.0
"""How long after ``body_timeout_s`` a connection still receiving its body is closed: the
application's 408 comes first."""

State = Literal["waiting", "receiving", "answering"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionLimits:
    """What ``ConnectionGuard`` enforces (``HttpSettings``, sized under the open-file limit).

    Attributes:
        max_connections: connections open at once.
        max_waiting: connections at once without a whole request head.
        header_timeout_s: the longest a connection may wait without a whole request head.
        body_timeout_s: the longest a request may take to send its body after its head.
    """

    max_connections: int
    max_waiting: int
    header_timeout_s: float
    body_timeout_s: float

    def __post_init__(self) -> None:
        if not 1 <= self.max_waiting <= self.max_connections:
            raise ValueError(f"max_waiting must be 1 to max_connections ({self.max_connections}),"
                             f" got {self.max_waiting}")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError("header_timeout_s and body_timeout_s must be > 0")


def open_file_limit() -> int | None:
    """The process's soft limit on open files (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def limits_within(settings: HttpSettings, max_open_files: int | None) -> ConnectionLimits:
    """``settings``' limits, with ``max_connections`` at most half of ``max_open_files``.

    The other half is for everything else the process opens: the gRPC front's connections,
    the disk tier, the model's files, Redis. Lowering is logged: ``ulimit -n`` raises it.
    """
    max_connections = settings.max_connections
    if max_open_files is not None and max_connections > max_open_files // 2:
        max_connections = max(1, max_open_files // 2)
        logger.warning("[http] max_connections lowered from %d to %d: half the process's "
                       "open-file limit (%d); raise it (ulimit -n) for more",
                       settings.max_connections, max_connections, max_open_files)
    return ConnectionLimits(
        max_connections=max_connections,
        max_waiting=min(settings.max_waiting_connections, max_connections),
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
    )


class ConnectionGuard:
    """The connections of one front, by state; closes the ones over a cap.

    Called only from the front's event loop (the protocols' callbacks). ``_waiting`` is in the
    order the connections began waiting, so the first one is the one that has waited longest.

    Args:
        limits: the caps and deadlines.
    """

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._open: set[GuardedH11Protocol] = set()
        self._waiting: dict[GuardedH11Protocol, None] = {}
        self.num_closed_over_cap = 0
        self.num_closed_late = 0

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def opened(self, connection: GuardedH11Protocol) -> None:
        """A new connection; over ``max_connections``, the longest-waiting one is closed."""
        self._open.add(connection)
        if len(self._open) > self.limits.max_connections:
            self._close_over_cap(next(iter(self._waiting), connection), "max_connections")

    def waiting(self, connection: GuardedH11Protocol) -> None:
        """``connection`` waits for a request head; over ``max_waiting``, the longest-waiting
        one is closed."""
        self._waiting.pop(connection, None)
        self._waiting[connection] = None
        if len(self._waiting) > self.limits.max_waiting:
            self._close_over_cap(next(iter(self._waiting)), "max_waiting_connections")

    def busy(self, connection: GuardedH11Protocol) -> None:
        """``connection`` sent a whole request head."""
        self._waiting.pop(connection, None)

    def closed(self, connection: GuardedH11Protocol) -> None:
        self._open.discard(connection)
        self._waiting.pop(connection, None)

    def late(self, connection: GuardedH11Protocol, state: State) -> None:
        """``connection`` ran past the deadline of ``state``: closed."""
        self.num_closed_late += 1
        logger.debug("closing an HTTP connection %s past its deadline", state)
        self.closed(connection)
        connection.drop()

    def _close_over_cap(self, connection: GuardedH11Protocol, cap: str) -> None:
        self.num_closed_over_cap += 1
        logger.debug("closing an HTTP connection waiting for a request: [http] %s reached", cap)
        self.closed(connection)
        connection.drop()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and caps of a ``ConnectionGuard``.

    A new request head shows as a new ``cycle`` (uvicorn makes one per ``h11.Request``), so the
    protocol compares it before and after uvicorn handles what arrived, and leaves uvicorn's
    own parsing untouched.

    Args:
        config, server_state, app_state, _loop: what uvicorn passes to a protocol class.
        guard: the front's guard.
        grpc_port: the gRPC service's port, named to a gRPC client that reached this one
            (None: not known).
    """

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *,
                 guard: ConnectionGuard, grpc_port: int | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._guard = guard
        self._state: State = "waiting"
        self._timer: asyncio.TimerHandle | None = None
        self._grpc_port = grpc_port
        self._first_bytes: bytes | None = b""  # None once the protocol is known
        self._refusal: GrpcRefusal | None = None

    # ---- asyncio.Protocol and uvicorn's hooks --------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._guard.opened(self)
        if not transport.is_closing():
            self._begin_waiting()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._guard.closed(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._first_bytes is not None:  # a new connection: HTTP/1.1, or a gRPC client?
            data = self._first_bytes + data
            if might_be_preface(data):
                if len(data) < len(PREFACE):
                    self._first_bytes = data  # not enough to tell yet
                    return
                self._refusal = GrpcRefusal(refusal_message(self.server, self._grpc_port))
                logger.debug("a gRPC client reached the HTTP front from %s: refused",
                             self.client)
                self.transport.write(self._refusal.opening())
            self._first_bytes = None
        if self._refusal is not None:
            self._answer_grpc(data)
            return
        cycle = self.cycle
        super().data_received(data)
        self._after_events(cycle)

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if not self.transport.is_closing():
            self._begin_waiting()
        super().on_response_complete()  # may start a pipelined request
        self._after_events(cycle)

    def _answer_grpc(self, data: bytes) -> None:
        assert self._refusal is not None
        if self.transport.is_closing():
            return
        self.transport.write(self._refusal.feed(data))
        if self._refusal.is_done:
            self._disarm()
            self.transport.close()  # after what was written

    def drop(self) -> None:
        """Close now, dropping what is still buffered for a client that does not read."""
        self._disarm()
        if not self.transport.is_closing():
            self.transport.abort()

    # ---- states ---------------------------------------------------------------------------

    def _begin_waiting(self) -> None:
        self._state = "waiting"
        self._arm(self._guard.limits.header_timeout_s)
        self._guard.waiting(self)

    def _after_events(self, previous: RequestResponseCycle | None) -> None:
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        if cycle is not previous and not cycle.response_complete:  # a new request head
            self._guard.busy(self)
            self._state = "receiving"
            self._arm(self._guard.limits.body_timeout_s + BODY_GRACE_S)
        if self._state == "receiving" and not cycle.more_body:
            self._state = "answering"
            self._disarm()

    def _arm(self, delay_s: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, self._late, self._state)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self, state: State) -> None:
        self._timer = None
        if self._state == state and not self.transport.is_closing():
            self._guard.late(self, state)
