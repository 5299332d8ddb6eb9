"""A router's side of the KV events, for the tests: vLLM's structs, a SUB socket that does not
miss the first messages, and a replay client.

The structs mirror ``vllm/distributed/kv_events.py`` (vllm-project/vllm) as a vLLM subscriber
declares them -- they are the contract, written here independently of
``gateway.service.kv_events.wire`` so that a drift in kvgate's own copy fails the tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from gateway.service.kv_events.publisher import KVEventPublisher

TOPIC = "kv-events"

# ---- vLLM's structs (vllm/distributed/kv_events.py) ------------------------------------------

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
END_SEQ = -1


def wire_hash(key: bytes) -> int:
    """What a router must see for a kvgate block key: its low 64 bits, unsigned."""
    return int.from_bytes(key[-8:], "big")


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def wait_for_messages(publisher: KVEventPublisher, num_messages: int) -> None:
    """Until the publisher has sent ``num_messages`` messages in all."""
    wait_until(lambda: publisher.num_messages == num_messages)


class Subscriber:
    """A router's SUB socket, connected once the publisher's messages reach it.

    NOTE: a SUB socket misses what is sent before its subscription reaches the publisher (the
    "slow joiner"); so it publishes ``AllBlocksCleared`` probes until one arrives, then
    reads past every probe, so that what follows arrives whole.
    """

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], publisher: KVEventPublisher,
                 topic: str = TOPIC) -> None:
        self.sock = context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sock.connect(publisher.endpoint)
        num_sent = publisher.num_events  # the events before, then one per probe
        while True:
            publisher.cleared()
            num_sent += 1
            if self.sock.poll(50):
                break
        wait_until(lambda: publisher.num_events == num_sent)
        last = publisher.num_messages - 1
        while self.receive()[0] != last:
            pass

    def receive(self, timeout_ms: int = 5000) -> tuple[int, KVEventBatch]:
        assert self.sock.poll(timeout_ms), "no message"
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == TOPIC.encode()
        return int.from_bytes(seq, "big"), DECODER.decode(payload)

    def events(self, count: int) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The next ``count`` events, whichever messages carry them, one block each.

        NOTE: the publisher may send removals that are queued together as one event with
        several hashes; how many depends on timing, so they are split here, one per block.
        """
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        while len(out) < count:
            for event in self.receive()[1].events:
                if isinstance(event, BlockRemoved):
                    out.extend(BlockRemoved(block_hashes=[h], medium=event.medium,
                                            group_idx=event.group_idx)
                               for h in event.block_hashes)
                else:
                    out.append(event)
        assert len(out) == count
        return out


def replay(context: zmq.Context[zmq.Socket[bytes]], publisher: KVEventPublisher,
           start: int) -> list[tuple[int, KVEventBatch]]:
    """Everything the replay socket returns from sequence number ``start`` on: [b"", seq] out
    (what a REQ socket sends), then [b"", topic, seq, payload] back per message, until
    [b"", b"", -1, b""].

    NOTE: a DEALER, not vLLM's example REQ: a REQ socket takes one reply per request, and
    the replay answers with one message per buffered batch (a REQ client sees the first only).
    """
    assert publisher.replay_endpoint is not None
    dealer = context.socket(zmq.DEALER)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    out = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        empty, topic, seq_bytes, payload = dealer.recv_multipart()
        assert empty == b""
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == END_SEQ:
            assert (topic, payload) == (b"", b"")
            break
        assert topic == TOPIC.encode()
        out.append((seq, DECODER.decode(payload)))
    dealer.close(linger=0)
    return out
