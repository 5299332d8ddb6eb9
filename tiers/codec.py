"""The block codec: one self-describing, authenticated blob per KV block, for disk and Redis.

Bytes that come back from a file or from a shared Redis are untrusted: a crash can leave half a
file, another deployment can write with another secret, anyone who can write to Redis can
forge values -- and one forged Redis value would be served by every replica. So every blob
carries who it is (key, parent key, namespace digest, tokens) and what it holds (dtype, shapes,
compression, lengths), and one keyed BLAKE3 MAC, the block tag, covers that header *and* the
payload (``tiers.block_mac`` says why a checksum of the payload is not enough). A second tag
over the header alone lets a restart adopt a file from one small read. Decoding trusts
nothing: shapes and sizes are checked against the model's ``KVLayout`` (never taken from the
header), every length is bounded before anything is allocated, and the payload is plain
little-endian tensor bytes -- no pickle, no ``torch.load``, nothing that could run code.

The byte layout is in ``tiers.block_format``. ``decode`` checks, cheapest first: the prefix
(magic, version, header length), the header tag, the fields against the layout, the exact
total length, the expected identity, then the block tag over header and payload, and only then
decompresses (output bounded to the layout's size). Every failure raises ``CodecError`` with a
stable ``reason`` (see ``tiers.base``); foreign errors (struct, lz4, unicode) are translated at
this boundary. A block of an older format -- 1 (header-only MAC, xxh3 payload checksum) or 2
(no expiry) -- is refused as "version": the stores count it, delete it and the block is
recomputed.

A codec built with ``quantize`` ("int8", "fp8") stores a lossy payload instead
(``tiers.payload_format``, ``tiers.kv_quant``): its headers carry the quantized format's code,
which an exact codec refuses as "shape" (and the other way round), and the blocks it decodes
are marked with their quantization, which an exact codec refuses to encode. A lossy tier's
blocks are named in a namespace of their own (``gateway.core.fingerprint.lossy_namespace``);
docs/design.md, "Lossy tiers".

The header also carries the block's expiry (``BlockMeta.expiry``: its sliding TTL and when it
expired as of writing), under the same MAC, so that a block keeps its lifetime wherever it goes.
"""

from __future__ import annotations

import struct
import sys
from typing import Literal

import lz4.frame
import numpy as np
import torch

from gateway.core.quantization import QUANTIZATIONS, Quantization
from tiers.base import BlockMeta, CodecError, TierConfigError
from tiers.block_format import (
    COMPRESSION_TO_ID,
    DTYPE_TO_CODE,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_LEN,
    MAX_KEY_LEN,
    MAX_OWNER_BYTES,
    MIN_HEADER_LEN,
    NAMESPACE_DIGEST_LEN,
    PREFIX_LEN,
    TAGS_LEN,
    Compression,
    DecodedHeader,
    ExpectedShape,
    HeaderFields,
    expiry_fields,
    header_length,
    pack_body,
    parse_fields,
)
from tiers.block_mac import MAC_LEN, BlockMac, derive_mac_key
from tiers.kv_quant import supported
from tiers.payload import KVBlock, KVLayout, PayloadError
from tiers.payload_format import QuantizedPayload, packed_of, payload_format

__all__ = [
    "FORMAT_VERSION",
    "MAC_LEN",
    "MAGIC",
    "PREFIX_LEN",
    "BlockCodec",
    "CompressionMode",
    "DecodedHeader",
    "derive_mac_key",
]

CompressionMode = Literal["raw", "lz4", "auto"]
_COMPRESSION_MODES: tuple[CompressionMode, ...] = ("raw", "lz4", "auto")


def _as_byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat unsigned-byte view of ``data``, without copying."""
    try:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    except (TypeError, ValueError) as exc:
        raise CodecError("codec", f"block bytes are not a contiguous byte buffer: {exc}") from exc
    return view


class BlockCodec:
    """Encodes and verifies the blobs of one model's KV blocks.

    One codec per (deployment secret, model layout, block size): everything a header says
    about shapes must equal what this codec was built with, so a blob from another model,
    dtype or block size is refused even when its MAC is valid.

    Args:
        mac_key: key of the block MAC (``derive_mac_key``), 16..64 bytes.
        layout: the model's KV layout; every block must match it.
        block_tokens: tokens per block.
        compression: "raw" (default: lz4 saves only 1-1.5% on real KV), "lz4", or "auto"
            (lz4 kept only where it saves at least ``min_lz4_saving`` of the raw size).
        min_lz4_saving: fraction of the raw size that "auto" needs lz4 to save.
        quantize: None (exact, the default), or the lossy format this codec stores ("int8",
            "fp8"): for a tier configured with ``quantize``, and only under a lossy namespace.
        device_type: where the engine computes ("cpu", "cuda"): blocks are quantized there
            (fp8 needs torch to cast there), and block tags are verified on every core only
            where it is not the CPU (``BlockMac``: the host's cores are otherwise the engine's).

    Raises:
        TierConfigError: a bad argument, a dtype without a format code, a quantization torch
            cannot do on ``device_type``, or a big-endian host (the payload is native tensor
            bytes, defined little-endian).
    """

    def __init__(
        self,
        *,
        mac_key: bytes,
        layout: KVLayout,
        block_tokens: int,
        compression: CompressionMode = "raw",
        min_lz4_saving: float = 0.05,
        quantize: Quantization | None = None,
        device_type: str = "cpu",
    ) -> None:
        if sys.byteorder != "little":
            raise TierConfigError(
                "the block codec stores native tensor bytes as little-endian and cannot run on "
                f"a {sys.byteorder}-endian host"
            )
        if block_tokens < 1:
            raise TierConfigError(f"block_tokens must be >= 1, got {block_tokens}")
        if layout.dtype not in DTYPE_TO_CODE:
            raise TierConfigError(
                f"KV dtype {layout.dtype} has no block format code; supported: "
                + ", ".join(str(d) for d in DTYPE_TO_CODE)
            )
        if compression not in _COMPRESSION_MODES:
            raise TierConfigError(
                f"unknown compression {compression!r}; expected one of {list(_COMPRESSION_MODES)}"
            )
        if not 0.0 <= min_lz4_saving < 1.0:
            raise TierConfigError(f"min_lz4_saving must be in [0, 1), got {min_lz4_saving}")
        if 4 * block_tokens + 2 * MAX_KEY_LEN + MAX_OWNER_BYTES + MIN_HEADER_LEN > MAX_HEADER_LEN:
            raise TierConfigError(f"block_tokens {block_tokens} is too large for a block header")
        if quantize is not None and quantize not in QUANTIZATIONS:
            raise TierConfigError(f"unknown quantize {quantize!r}; expected one of "
                                  f"{list(QUANTIZATIONS)} or none")
        if quantize is not None and not supported(quantize, device_type):
            raise TierConfigError(f"torch {torch.__version__} cannot quantize K/V to {quantize} "
                                  f"on {device_type}: use int8")
        # BlockMac raises TierConfigError for a key of a bad length.
        self._mac = BlockMac(mac_key, verify_on_every_core=device_type != "cpu")
        self._layout = layout
        self._block_tokens = block_tokens
        self._compression: CompressionMode = compression
        self._min_lz4_saving = min_lz4_saving
        self._format = payload_format(layout, block_tokens, quantize)
        self._dtype_code = self._format.format_code
        self._raw_len = self._format.raw_len
        # lz4 frames of incompressible data grow by a few bytes per 64 KiB block plus the frame
        # header; anything beyond this bound is not an lz4 frame of raw_len bytes.
        self._shape = ExpectedShape(
            layout=layout,
            block_tokens=block_tokens,
            raw_len=self._raw_len,
            max_lz4_len=self._raw_len + self._raw_len // 255 + 1024,
            format_code=self._dtype_code,
        )

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    @property
    def raw_len(self) -> int:
        """Payload bytes of one block before compression."""
        return self._raw_len

    @property
    def quantization(self) -> Quantization | None:
        """None: exact; else the lossy format this codec stores."""
        return self._format.quantization

    def stored_copy(self, block: KVBlock) -> KVBlock:
        """The block as a tier with this codec serves it once written: ``block`` itself when
        exact, its dequantized copy (marked) when lossy -- so that a tier serving a write still
        queued serves what it will serve from then on, not the exact original."""
        if not isinstance(self._format, QuantizedPayload):
            return block
        return self._format.round_trip(block)

    @property
    def mac(self) -> BlockMac:
        """The MAC this codec signs and verifies with (the tiers benchmark times it alone)."""
        return self._mac

    # ----------------------------------------------------------------------------- encode

    def encode(self, meta: BlockMeta, block: KVBlock) -> bytes:
        """Serialise ``block`` with its identity ``meta`` into one authenticated blob.

        The block's tensors may live on any device and need not be contiguous; they are read,
        never modified (the MAC streams over the same views that are then joined into the
        blob, so a tensor written to meanwhile would only produce a blob that fails to verify).

        Raises:
            CodecError: ``meta`` or ``block`` does not fit the format or the codec's layout
                (reason "key", "parent", "namespace", "tokens", "size" or "shape"; "shape"
                too for a dequantized block given to an exact codec, or K/V that is not
                finite given to a quantizing one).
        """
        self._check_meta_for_encode(meta)
        try:
            block.check(self._layout, self._block_tokens)
        except PayloadError as exc:
            raise CodecError("shape", f"cannot encode block: {exc}") from exc
        pieces: list[memoryview | bytes] = list(self._format.pieces(block))

        compression: Compression = "raw"
        if self._compression != "raw":
            raw = b"".join(pieces)
            packed: bytes = lz4.frame.compress(raw, store_size=True)
            saving = len(raw) - len(packed)
            if self._compression == "lz4" or saving >= self._min_lz4_saving * len(raw):
                compression, pieces = "lz4", [packed]
            else:
                pieces = [raw]

        ttl_ms, expires_at_ms = expiry_fields(meta.expiry)
        body = pack_body(
            HeaderFields(
                dtype_code=self._dtype_code,
                compression_id=COMPRESSION_TO_ID[compression],
                key=bytes(meta.key),
                parent_key=bytes(meta.parent_key),
                owner=meta.owner.encode("utf-8"),
                num_tokens=len(meta.tokens) // 4,
                tokens=bytes(meta.tokens),
                num_layers=self._layout.num_layers,
                kv_heads=self._layout.kv_heads,
                block_tokens=self._block_tokens,
                head_dim=self._layout.head_dim,
                payload_len=sum(len(p) for p in pieces),
                raw_len=self._raw_len,
                namespace_digest=bytes(meta.namespace_digest),
                ttl_ms=ttl_ms,
                expires_at_ms=expires_at_ms,
            )
        )
        block_tag = self._mac.block_tag(body, pieces)
        header_tag = self._mac.header_tag(body, block_tag)
        # One copy of the tensor bytes: straight from the tensors into the result.
        return b"".join([body, block_tag, header_tag, *pieces])

    def _check_meta_for_encode(self, meta: BlockMeta) -> None:
        if not 1 <= len(meta.key) <= MAX_KEY_LEN:
            raise CodecError(
                "key", f"block key must be 1..{MAX_KEY_LEN} bytes, got {len(meta.key)}"
            )
        if len(meta.parent_key) > MAX_KEY_LEN:
            raise CodecError(
                "parent",
                f"parent key must be at most {MAX_KEY_LEN} bytes, got {len(meta.parent_key)}",
            )
        if len(meta.namespace_digest) != NAMESPACE_DIGEST_LEN:
            raise CodecError(
                "namespace",
                f"namespace digest must be {NAMESPACE_DIGEST_LEN} bytes, "
                f"got {len(meta.namespace_digest)}",
            )
        if len(meta.tokens) != 4 * self._block_tokens:
            raise CodecError(
                "tokens",
                f"a block holds {self._block_tokens} tokens ({4 * self._block_tokens} bytes), "
                f"got {len(meta.tokens)} bytes",
            )
        try:
            owner_len = len(meta.owner.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise CodecError("codec", f"owner is not encodable as utf-8: {exc}") from exc
        if owner_len > MAX_OWNER_BYTES:
            raise CodecError(
                "size", f"owner must be at most {MAX_OWNER_BYTES} utf-8 bytes, got {owner_len}"
            )

    # ----------------------------------------------------------------------------- decode

    @staticmethod
    def header_length(prefix: bytes | memoryview) -> int:
        """The header length (bytes before the payload) read from the first PREFIX_LEN bytes.

        Raises:
            CodecError: fewer than PREFIX_LEN bytes ("truncated"), another magic ("magic") or
                format version ("version"), or a length out of bounds ("size").
        """
        return header_length(_as_byte_view(prefix))

    def read_header(self, data: bytes | bytearray | memoryview) -> DecodedHeader:
        """Authenticate and check the header at the start of ``data`` (the payload may be
        absent: only the first ``header_len`` bytes are read).

        This checks the header tag only: enough to trust the identity, sizes and layout of a
        block file at restart, nothing about its payload.

        Raises:
            CodecError: reasons "truncated", "magic", "version", "size", "mac", "codec",
                "shape".
        """
        view = _as_byte_view(data)
        header_len = header_length(view[:PREFIX_LEN])
        if len(view) < header_len:
            raise CodecError(
                "truncated", f"block truncated: {len(view)} of {header_len} header bytes"
            )
        body_len = header_len - TAGS_LEN
        block_tag = view[body_len : body_len + MAC_LEN]
        if not self._mac.is_header_tag(
            view[body_len + MAC_LEN : header_len], view[:body_len], block_tag
        ):
            raise CodecError(
                "mac", "header MAC mismatch: written with another deployment secret or tampered"
            )
        try:
            return parse_fields(view, header_len, self._shape)
        except (struct.error, IndexError, ValueError, OverflowError) as exc:
            # NOTE: unreachable for headers this codec wrote; a forged header that passed the
            # MAC is a leaked key, but it must still fail as a CodecError, never a crash.
            raise CodecError("codec", f"malformed block header: {exc}") from exc

    def decode(self, data: bytes | bytearray | memoryview, expected: BlockMeta, *,
               into: KVBlock | None = None) -> KVBlock:
        """Verify ``data`` as the encoding of the block ``expected`` and return its tensors
        (``decode_with_header`` also returns the verified header: its expiry, for instance;
        ``into`` is its too).

        Raises:
            CodecError: see ``decode_with_header``.
        """
        return self.decode_with_header(data, expected, into=into)[1]

    def decode_with_header(self, data: bytes | bytearray | memoryview, expected: BlockMeta,
                           *, into: KVBlock | None = None
                           ) -> tuple[DecodedHeader, KVBlock]:
        """Verify ``data`` as the encoding of the block ``expected``; its header and tensors.

        The returned tensors own their memory (one buffer for the whole block; or the block
        returned is ``into``, a page of the pool, ``PayloadFormat.unpack``, written
        only once the block is verified): the caller may reuse or release ``data`` at once. A
        raw payload is copied first and the block tag is checked over that private copy, so
        the bytes served are the bytes verified even if ``data`` is a buffer someone else can
        still write (immutable ``bytes`` are checked in place); an lz4 payload is verified
        before it is decompressed (lz4 never sees unauthenticated bytes).

        NOTE: the identity is compared before the block tag and decompression, so a foreign
        block costs no payload work; every check runs either way, only the reported reason of
        a blob that is wrong twice depends on the order.

        Raises:
            CodecError: any reason of ``read_header``, or "truncated"/"size" (total length),
                "key", "parent", "namespace", "tokens" (not the expected block), "payload_mac"
                (the payload is not the one the block tag was made over: corrupted or forged),
                "codec" (payload does not decompress to exactly the layout's size).
        """
        view = _as_byte_view(data)
        header = self.read_header(view)
        if len(view) < header.total_len:
            raise CodecError(
                "truncated", f"block truncated: {len(view)} of {header.total_len} bytes"
            )
        if len(view) > header.total_len:
            raise CodecError(
                "size",
                f"block has {len(view) - header.total_len} trailing bytes after {header.total_len}",
            )
        _check_identity(header.meta, expected)

        body = view[: header.body_len]
        payload = view[header.header_len :]
        if header.compression == "lz4":
            self._check_block_tag(header, body, payload)
            flat = torch.frombuffer(self._decompress(payload), dtype=torch.uint8)
        elif (into is not None and isinstance(data, bytes) and self._format.quantization is None
              and packed_of(into).device.type == "cpu"):
            # Immutable bytes (a Redis reply, a file read): nobody can change them after they
            # are verified, so they are copied once, into the page, not privately first.
            self._check_block_tag(header, body, payload)
            _copy_exact_into(payload, packed_of(into))
            return header, into
        else:
            # For a page on a GPU the private copy is pinned (torch's caching host allocator:
            # reused, not registered per block), so the copy up is one DMA at the bus's speed
            # (an H100 took 1 GiB in 20-24 ms from pinned memory, 164 ms from pageable:
            # docs/gpu.md, "Copies to the GPU").
            to_gpu = into is not None and packed_of(into).device.type == "cuda"
            flat = torch.empty(self._raw_len, dtype=torch.uint8, pin_memory=to_gpu)
            private = flat.numpy()
            np.copyto(private, np.frombuffer(payload, dtype=np.uint8))
            self._check_block_tag(header, body, private.data)

        return header, self._format.unpack(flat, into=into)

    def _check_block_tag(
        self, header: DecodedHeader, body: memoryview, payload: memoryview
    ) -> None:
        if not self._mac.is_block_tag(header.block_tag, body, (payload,)):
            raise CodecError(
                "payload_mac", "block MAC mismatch: the payload was corrupted or forged"
            )

    def _decompress(self, payload: memoryview) -> bytearray:
        """Decompress one lz4 frame into a new bytearray of exactly raw_len bytes, never
        letting lz4 produce more."""
        decompressor = lz4.frame.LZ4FrameDecompressor(return_bytearray=True)
        try:
            out: bytearray = decompressor.decompress(payload, max_length=self._raw_len)
        except RuntimeError as exc:  # lz4 reports every malformed frame as RuntimeError
            raise CodecError("codec", f"lz4 payload does not decompress: {exc}") from exc
        if not decompressor.eof:
            raise CodecError(
                "codec",
                f"lz4 payload holds more than the layout's {self._raw_len} bytes, or its frame "
                "is cut short",
            )
        unused = decompressor.unused_data or b""
        if len(out) != self._raw_len or unused:
            raise CodecError(
                "codec",
                f"lz4 payload decompresses to {len(out)} bytes with {len(unused)} bytes after "
                f"its frame; the layout has {self._raw_len}",
            )
        return out


def _check_identity(stored: BlockMeta, expected: BlockMeta) -> None:
    """Raise unless the stored identity is the expected one (owner is informational)."""
    if stored.key != expected.key:
        raise CodecError("key", "block key differs from the requested key")
    if stored.parent_key != expected.parent_key:
        raise CodecError("parent", "block parent key differs from the expected parent")
    if stored.namespace_digest != expected.namespace_digest:
        raise CodecError("namespace", "block was written in another namespace")
    if stored.tokens != expected.tokens:
        raise CodecError("tokens", "block tokens differ from the expected tokens")


_SAME_SIZE_INTEGER = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16),
                      4: (np.int32, torch.int32), 8: (np.int64, torch.int64)}
"""Per element size, an integer type of that size in numpy and in torch: bytes copied as bits."""


def _copy_exact_into(payload: memoryview, into: torch.Tensor) -> None:
    """Copy an exact payload's bytes into ``into`` (``[layers, 2, kv_heads, tokens,
    head_dim]``, any strides) through numpy, as integers of the element's size: torch would
    warn that the bytes object it reads is not writable."""
    as_numpy, as_torch = _SAME_SIZE_INTEGER[into.element_size()]
    source = np.frombuffer(payload, dtype=as_numpy).reshape(tuple(into.shape))
    np.copyto(into.view(as_torch).numpy(), source)
