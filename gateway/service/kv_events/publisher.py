"""The KV-events publisher: the cache's ``TierEvents`` observer, sending vLLM's KV events.

The protocol is vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``), so a router
pointed at a vLLM replica can be pointed at kvgate instead:

  * a PUB socket sends one message per batch, three frames: ``[topic, sequence number (8
    bytes, big-endian, from 0, one more per message), payload (a msgpack KVEventBatch)]``;
  * a ROUTER socket answers replay requests: a client sends ``[b"", first sequence number it
    wants (8 bytes, big-endian)]`` and receives every buffered message from there on as ``[b"",
    topic, seq, payload]``, then the end marker ``[b"", b"", seq -1 (8 bytes, signed), b""]``.
    The buffer keeps the last ``buffer_size`` messages; older ones are gone (the router must
    rebuild). NOTE: the answer is several messages, so the client must be a DEALER; a REQ socket
    (vLLM's example subscriber) adds the empty frame itself but takes one reply per request,
    and so sees only the first message of a replay.

Unlike vLLM's, the request path never waits here: the cache tells the publisher under its lock,
so ``stored``/``removed``/``cleared`` only put a small tuple on a bounded queue and return; when
the queue is full the event is dropped and counted (``num_dropped``; the router's view of this
replica is then stale until those blocks change again). One thread of its own turns queued
events into batches (up to ``max_batch`` events, whatever has accumulated), encodes and sends
them, and serves replay requests between batches (within ``POLL_S``). PUB and ROUTER sockets
drop what a slow subscriber cannot take (high-water marks) instead of blocking.

Errors: ``KVEventsError`` (a ``ServeError``: the gateway cannot start as configured) when an
endpoint cannot be bound.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import msgspec
import zmq

from gateway.config.events import EventsSettings
from gateway.core.fingerprint import Scope
from gateway.service.kv_events.wire import (
    TIER_TO_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_removed,
    block_stored,
    tenant_tag,
)
from gateway.service.server import ServeError
from policies.base import BlockKey
from tiers.base import BlockMeta

logger = logging.getLogger(__name__)

POLL_S = 0.05
"""How long the thread waits for an event before it looks at the replay socket again."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of the replay's end marker (vLLM's)."""
DATA_PARALLEL_RANK = 0
SEND_HWM = 100_000
"""Messages a socket queues per peer before it drops (vLLM's ``hwm``): a PUB drops for a
subscriber that falls that far behind, a ROUTER drops the rest of a replay."""
LINGER_MS = 500
"""How long closing waits for messages still queued to leave."""

SHARED_OWNER = Scope.shared().owner
"""The owner of the shared scope's blocks, which serve every tenant: they carry no tenant id."""
_STORED, _REMOVED, _CLEARED = 0, 1, 2
_Item = tuple[int, BlockMeta | BlockKey | None, str]
"""What the request path queues: (kind, block or key, medium)."""


class KVEventsError(ServeError):
    """The KV-events publisher cannot start (an endpoint cannot be bound)."""


class KVEventPublisher:
    """Publishes what the cache's device and host tiers gain and lose (a ``TierEvents``).

    ``__init__`` only assigns; ``start`` binds the sockets and starts the thread; ``close``
    sends what is queued and stops.

    Args:
        endpoint: where the PUB socket binds (``tcp://HOST:PORT``, ``ipc://PATH``; port 0 picks
            a free one, ``endpoint`` then says which). Checked by ``gateway.config.events``.
        replay_endpoint: where the replay ROUTER socket binds, or None for no replay.
        topic: the first frame of every message.
        buffer_size: messages kept for replay.
        max_queue: events waiting for the thread at most; more are dropped and counted.
        max_batch: events one message carries at most.
        clock: Unix time, for the batches' timestamps.
    """

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "kv-events",
        buffer_size: int = 10_000,
        max_queue: int = 65_536,
        max_batch: int = 1024,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if buffer_size < 1 or max_queue < 1 or max_batch < 1:
            raise ValueError("buffer_size, max_queue and max_batch must be >= 1")
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode("utf-8")
        self._max_batch = max_batch
        self._clock = clock
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=max_queue)
        self._buffer_size = buffer_size
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._next_seq = 0
        self._num_dropped = 0
        self._next_drop_log = 1
        self.num_events = 0
        """Events sent so far."""
        self.num_send_failures = 0
        """Messages the PUB socket refused (logged)."""

    @property
    def endpoint(self) -> str:
        """Where the PUB socket is bound (after ``start``: the port it got, if 0 was asked)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """Where the replay socket is bound, or None."""
        return self._replay_endpoint

    @property
    def num_messages(self) -> int:
        """Messages (batches) sent so far: the next sequence number."""
        return self._next_seq

    @property
    def num_dropped(self) -> int:
        """Events dropped because the queue was full."""
        return self._num_dropped

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the sockets and start the sending thread.

        Raises:
            KVEventsError: an endpoint cannot be bound (in use, no such address or path).
        """
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            self._pub = self._bind(context, zmq.PUB, self._endpoint, SEND_HWM)
            self._endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if self._replay_endpoint is not None:
                # A replay answers with up to the whole buffer at once: room for all of it.
                self._replay = self._bind(context, zmq.ROUTER, self._replay_endpoint,
                                          max(SEND_HWM, self._buffer_size + 1))
                self._replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            context.destroy(linger=0)
            self._pub = self._replay = None
            raise KVEventsError(f"cannot publish KV events: {exc} ([events] endpoints "
                                f"{self._endpoint}, {self._replay_endpoint})") from exc
        self._context = context
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("publishing KV events (vLLM's format) on %s, topic %r%s", self._endpoint,
                    self._topic.decode("utf-8"),
                    f", replay on {self._replay_endpoint}" if self._replay_endpoint else "")

    @staticmethod
    def _bind(context: zmq.Context[zmq.Socket[bytes]], kind: int, endpoint: str,
              send_hwm: int) -> zmq.Socket[bytes]:
        sock = context.socket(kind)
        sock.setsockopt(zmq.SNDHWM, send_hwm)  # before bind: it applies to later peers only
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)  # tcp://[::1]:PORT
        sock.bind(endpoint)
        return sock

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within ``timeout_s``), then close the sockets."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                logger.warning("the KV events thread did not stop in %.1f s; its sockets are "
                               "left open", timeout_s)
                return
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        if self._context is not None:
            self._context.term()
        self._pub = self._replay = None
        self._context = self._thread = None

    # ---- TierEvents: called by the cache, under its lock -------------------------------

    def stored(self, meta: BlockMeta, tier: str) -> None:
        """``tier`` holds the block ``meta`` names: a ``BlockStored`` (device and host only)."""
        medium = TIER_TO_MEDIUM.get(tier)
        if medium is not None:
            self._put((_STORED, meta, medium))

    def removed(self, key: BlockKey, tier: str) -> None:
        """``tier`` dropped ``key``: a ``BlockRemoved`` (device and host only)."""
        medium = TIER_TO_MEDIUM.get(tier)
        if medium is not None:
            self._put((_REMOVED, key, medium))

    def cleared(self) -> None:
        """Nothing is held any more: ``AllBlocksCleared``."""
        self._put((_CLEARED, None, ""))

    def _put(self, item: _Item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._num_dropped += 1
            if self._num_dropped >= self._next_drop_log:
                self._next_drop_log *= 10
                logger.warning("KV events: the queue is full, events are dropped (%d so far): "
                               "routers' view of this replica is stale until those blocks "
                               "change again", self._num_dropped)

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        tags: dict[bytes, str | None] = {}
        while True:
            self._serve_replay()
            try:
                first = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            items = [first]
            while len(items) < self._max_batch:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            batch = KVEventBatch(ts=self._clock(), events=self._events(items, tags),
                                 data_parallel_rank=DATA_PARALLEL_RANK)
            self._send(encoder.encode(batch), len(items))

    @staticmethod
    def _events(items: list[_Item], tags: dict[bytes, str | None]
                ) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The wire events of ``items``; consecutive removals from one medium share one."""
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for kind, what, medium in items:
            if kind == _STORED:
                assert isinstance(what, BlockMeta)
                digest = what.namespace_digest
                if digest not in tags:
                    tags[digest] = None if what.owner == SHARED_OWNER else tenant_tag(digest)
                events.append(block_stored(what, medium, tags[digest]))
            elif kind == _REMOVED:
                assert isinstance(what, bytes)
                last = events[-1] if events else None
                if isinstance(last, BlockRemoved) and last.medium == medium:
                    last.block_hashes.extend(block_removed([BlockKey(what)], medium).block_hashes)
                else:
                    events.append(block_removed([BlockKey(what)], medium))
            else:
                events.append(AllBlocksCleared())
        return events

    def _send(self, payload: bytes, num_events: int) -> None:
        assert self._pub is not None
        seq = self._next_seq.to_bytes(8, "big")
        try:
            self._pub.send_multipart((self._topic, seq, payload), copy=False)
        except zmq.ZMQError as exc:
            self.num_send_failures += 1
            logger.error("KV events: a batch of %d events could not be sent: %s", num_events, exc)
            return
        self._buffer.append((self._next_seq, payload))
        self._next_seq += 1
        self.num_events += num_events

    def _serve_replay(self) -> None:
        """Answer every waiting replay request (vLLM's protocol, module docstring)."""
        sock = self._replay
        if sock is None:
            return
        while sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or frames[1]:
                logger.warning("KV events: a replay request that is not [identity, b'', 8-byte "
                               "sequence number] (%d frames) is ignored", len(frames))
                continue
            client, _, start = frames
            if len(start) == 8:
                first = int.from_bytes(start, "big")
                for seq, payload in self._buffer:
                    if seq >= first:
                        sock.send_multipart(
                            (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            sock.send_multipart((client, b"", b"", END_SEQ, b""))


def open_kv_events(settings: EventsSettings) -> KVEventPublisher | None:
    """The started publisher ``[events]`` configures, or None when it is off.

    Raises:
        KVEventsError: an endpoint cannot be bound.
    """
    if not settings.is_enabled:
        return None
    publisher = KVEventPublisher(
        endpoint=settings.kv_events_endpoint,
        replay_endpoint=settings.kv_events_replay_endpoint or None,
        topic=settings.kv_events_topic,
        buffer_size=settings.kv_events_buffer,
    )
    publisher.start()
    return publisher
