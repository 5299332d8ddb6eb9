"""A gRPC client on the HTTP API's port: answered in gRPC's own words, then closed.

Pointed at the OpenAI-compatible port (``kvgate generate --port 8000``), a gRPC client sends
HTTP/2's connection preface (``PRI * HTTP/2.0``) where h11 expects an HTTP/1.1 request line.
uvicorn would answer ``400 Bad Request`` in HTTP/1.1, which the client cannot parse either: it
reported ``Failed parsing HTTP/2 (Expected SETTINGS frame as the first frame, got frame type
79)`` and retried until its deadline. So the front's protocol (``connections``) hands such a
connection to ``GrpcRefusal``, which speaks just enough HTTP/2 to end the client's first call
with a status of its own -- ``UNIMPLEMENTED`` and a message naming the port the client wanted
-- then sends GOAWAY and closes. Any gRPC client shows that message as the call's error.

What it speaks (RFC 9113): the server preface (an empty SETTINGS frame), SETTINGS and PING
acknowledgements, and for the first HEADERS frame a *trailers-only* response on its stream
(``:status 200``, ``content-type: application/grpc``, ``grpc-status``, ``grpc-message``), the
header block written with HPACK literals that touch no dynamic table. Frames are not checked
beyond their length: whatever the client sends, the connection ends after one answer, or at
``MAX_BUFFERED`` bytes, or at the front's header deadline.

NOTE: plaintext only. With TLS a gRPC client asks for ``h2`` by ALPN during the handshake,
which uvicorn does not offer; that client fails in the handshake, before any of this.
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
"""What every HTTP/2 client sends first (RFC 9113, 3.4)."""
MAX_BUFFERED = 1 << 20
"""Bytes of unanswered frames kept at most; past it the connection is simply closed."""
GRPC_UNIMPLEMENTED = 12

_FRAME_HEADER = 9
_HEADERS, _SETTINGS, _PING, _GOAWAY = 0x1, 0x4, 0x6, 0x7
_END_STREAM, _END_HEADERS, _ACK = 0x1, 0x4, 0x1
_NO_ERROR = 0x0
_STATUS_200 = 0x88
"""HPACK's static table entry 8, ``:status: 200``, as an indexed field."""


def refusal_message(local: tuple[str, int | None] | None, grpc_port: int | None) -> str:
    """What a gRPC client on the HTTP port is told.

    Args:
        local: the address the client reached (the connection's local end), if known.
        grpc_port: the port the gRPC service listens on (None: not known here).
    """
    where = "this port"
    if local is not None and local[1]:
        host = f"[{local[0]}]" if ":" in local[0] else local[0]
        where = f"{host}:{local[1]}"
    on = (f"port {grpc_port} ([server] port, kvgate --port)" if grpc_port else
          "its own port ([server] port, kvgate --port; 50051 by default)")
    return (f"{where} is kvgate's OpenAI-compatible HTTP API (HTTP/1.1), not gRPC: kvgate's "
            f"gRPC service listens on {on}")


def might_be_preface(data: bytes) -> bool:
    """Whether ``data``, a connection's first bytes, begins the HTTP/2 preface (or is all of a
    beginning of it: more bytes must arrive to tell)."""
    return data[:len(PREFACE)] == PREFACE[:len(data)]


class GrpcRefusal:
    """One connection that sent the HTTP/2 preface: what to write back, frame by frame.

    Args:
        message: the ``grpc-message`` of the answer (what the client's error will say).
    """

    def __init__(self, message: str) -> None:
        self._message = message
        self._buffer = bytearray()
        self._is_preface_read = False
        self.is_done = False

    def opening(self) -> bytes:
        """The server's preface: its (empty) SETTINGS, written as soon as the client's came."""
        return _frame(_SETTINGS, 0, 0, b"")

    def feed(self, data: bytes) -> bytes:
        """Take what the client sent; return what to write (``is_done``: then close)."""
        self._buffer += data
        if not self._is_preface_read:
            if len(self._buffer) < len(PREFACE):
                return b""
            del self._buffer[:len(PREFACE)]
            self._is_preface_read = True
        out = bytearray()
        while not self.is_done and len(self._buffer) >= _FRAME_HEADER:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < _FRAME_HEADER + length:
                break
            kind, flags = self._buffer[3], self._buffer[4]
            stream = int.from_bytes(self._buffer[5:9], "big") & 0x7FFF_FFFF
            payload = bytes(self._buffer[_FRAME_HEADER:_FRAME_HEADER + length])
            del self._buffer[:_FRAME_HEADER + length]
            if kind == _SETTINGS and not flags & _ACK:
                out += _frame(_SETTINGS, _ACK, 0, b"")
            elif kind == _PING and not flags & _ACK:
                out += _frame(_PING, _ACK, 0, payload)
            elif kind == _HEADERS and stream:
                out += _frame(_HEADERS, _END_STREAM | _END_HEADERS, stream, self._trailers())
                out += _frame(_GOAWAY, 0, 0, struct.pack(">II", stream, _NO_ERROR))
                self.is_done = True
        if len(self._buffer) > MAX_BUFFERED:
            self.is_done = True
        return bytes(out)

    def _trailers(self) -> bytes:
        return b"".join((
            bytes((_STATUS_200,)),
            _literal(b"content-type", b"application/grpc"),
            _literal(b"grpc-status", str(GRPC_UNIMPLEMENTED).encode()),
            _literal(b"grpc-message", _percent_encoded(self._message)),
        ))


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + struct.pack(
        ">I", stream) + payload


def _literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman (RFC 7541, 6.2.2)."""
    return b"\x00" + _integer(len(name), 7) + name + _integer(len(value), 7) + value


def _integer(value: int, prefix_bits: int) -> bytes:
    """HPACK's integer with an N-bit prefix (RFC 7541, 5.1); the prefix's flag bits are 0."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((value,))
    out = bytearray((limit,))
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def _percent_encoded(message: str) -> bytes:
    """``grpc-message`` as the gRPC spec writes it: UTF-8, with ``%`` and bytes outside
    printable ASCII percent-encoded."""
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
                    for b in message.encode("utf-8"))
