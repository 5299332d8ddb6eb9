"""The block codec: one self-describing, authenticated blob per KV block, for disk and Redis.

Bytes that come back from a file or from a shared Redis are untrusted: a crash can leave half a
file, another deployment can write with another secret, anyone who can write to Redis can
forge values. So every blob carries who it is (key, parent key, namespace digest, tokens),
what it holds (dtype, shapes, compression, lengths, an xxh3-128 checksum of the payload) and a
keyed BLAKE2b MAC over all of that. Decoding trusts nothing: shapes and sizes are checked
against the model's ``KVLayout`` (never taken from the header), every length is bounded before
anything is allocated, and the payload is plain little-endian tensor bytes -- no pickle, no
``torch.load``, nothing that could run code.

Format (all integers little-endian)::

    prefix  (PREFIX_LEN = 10)
      0   4s   MAGIC b"KVGB"
      4   u16  format version (FORMAT_VERSION)
      6   u32  header length: bytes before the payload (prefix + fields + MAC)
    fields  (fixed part, 90 bytes)
      10  u8   dtype code (``_DTYPE_CODES``)
      11  u8   compression id (0 raw, 1 lz4 frame)
      12  u8   key length (1..64)
      13  u8   parent key length (0..64)
      14  u16  owner length (utf-8 bytes, <= MAX_OWNER_BYTES)
      16  u32  number of tokens
      20  u32  num_layers
      24  u32  kv_heads
      28  u32  block_tokens
      32  u32  head_dim
      36  u64  payload length (stored bytes)
      44  u64  raw length (bytes after decompression)
      52  16s  xxh3-128 of the stored payload
      68  32s  namespace digest
    fields  (variable part)
      100      key, parent key, owner (utf-8), tokens (u32 each)
    MAC     32 bytes: keyed BLAKE2b-256 (key = mac_key) of everything before it
    payload for each layer: K bytes then V bytes, each [kv_heads, block_tokens, head_dim]
            C-contiguous; optionally one lz4 frame of those bytes

Checks happen cheapest first and before any allocation that a header could inflate: the prefix
(magic, version, header length within ``MAX_HEADER_LEN``), the MAC, then the fields against
the layout; ``decode`` then checks the exact total length, the expected identity, the checksum
and finally decompresses with the output bounded to the layout's size. Every failure raises
``CodecError`` with a stable ``reason`` (see ``tiers.base``); foreign errors (struct, lz4,
unicode) are translated at this boundary.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
from dataclasses import dataclass
from typing import Literal

import lz4.frame
import numpy as np
import torch
import xxhash

from policies.base import BlockKey
from tiers.base import BlockMeta, CodecError, TierConfigError
from tiers.payload import KVBlock, KVLayout, PayloadError

FORMAT_VERSION: int = 1
MAGIC: bytes = b"KVGB"

_PREFIX = struct.Struct("<4sHI")
PREFIX_LEN: int = _PREFIX.size
"""Bytes at the start of every blob from which ``BlockCodec.header_length`` reads the header
length (disk recovery reads this much, then the header, never the payload)."""

_FIELDS = struct.Struct("<BBBBHIIIIIQQ16s32s")
MAC_LEN = 32
CHECKSUM_LEN = 16
NAMESPACE_DIGEST_LEN = 32
MAX_KEY_LEN = 64
MAX_OWNER_BYTES = 256
MAX_HEADER_LEN = 1 << 20
"""Upper bound on any header (about 260k tokens per block); a longer claim is refused unread."""

_MIN_HEADER_LEN = PREFIX_LEN + _FIELDS.size + 1 + MAC_LEN
_MAC_PERSON = b"kvgate.blockmac"
_MAC_DOMAIN = b"kvgate.block-mac-key.v1"

Compression = Literal["raw", "lz4"]
CompressionMode = Literal["raw", "lz4", "auto"]

_COMPRESSION_TO_ID: dict[Compression, int] = {"raw": 0, "lz4": 1}
_ID_TO_COMPRESSION: dict[int, Compression] = {v: k for k, v in _COMPRESSION_TO_ID.items()}
_COMPRESSION_MODES: tuple[CompressionMode, ...] = ("raw", "lz4", "auto")


def _dtype_table() -> dict[int, torch.dtype]:
    # NOTE: codes are part of the format and never reused; dtypes this torch build lacks are
    # simply absent (a blob naming one is refused as "codec").
    names = {
        1: "float32",
        2: "float16",
        3: "bfloat16",
        4: "float64",
        5: "int8",
        6: "uint8",
        7: "float8_e4m3fn",
        8: "float8_e5m2",
        9: "float8_e4m3fnuz",
        10: "float8_e5m2fnuz",
    }
    table: dict[int, torch.dtype] = {}
    for code, name in names.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            table[code] = dtype
    return table


_CODE_TO_DTYPE: dict[int, torch.dtype] = _dtype_table()
_DTYPE_TO_CODE: dict[torch.dtype, int] = {v: k for k, v in _CODE_TO_DTYPE.items()}


def derive_mac_key(deployment_secret: bytes) -> bytes:
    """Derive the 32-byte key that MACs block headers from the deployment secret.

    A separate key (BLAKE2b personalised for this purpose, over its own domain string) so
    that a MAC can never equal a namespace digest, which is keyed by the same secret.

    Args:
        deployment_secret: the per-deployment secret, 16..64 bytes.

    Returns:
        32 bytes.

    Raises:
        TierConfigError: the secret is shorter than 16 or longer than 64 bytes.
    """
    if not 16 <= len(deployment_secret) <= 64:
        raise TierConfigError(
            f"deployment secret must be 16 to 64 bytes long, got {len(deployment_secret)}"
        )
    return hashlib.blake2b(
        _MAC_DOMAIN, key=deployment_secret, digest_size=MAC_LEN, person=_MAC_PERSON
    ).digest()


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedHeader:
    """A header that passed the MAC and the layout checks (the payload is not checked yet).

    Attributes:
        meta: the identity stored with the block.
        dtype, num_layers, kv_heads, block_tokens, head_dim: the stored layout (equal to the
            codec's, or the header would have been refused).
        compression: "raw" or "lz4".
        payload_len: stored payload bytes.
        raw_len: payload bytes after decompression.
        checksum: xxh3-128 of the stored payload.
        header_len: bytes before the payload (prefix + fields + MAC).
    """

    meta: BlockMeta
    dtype: torch.dtype
    num_layers: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    compression: Compression
    payload_len: int
    raw_len: int
    checksum: bytes
    header_len: int

    @property
    def total_len(self) -> int:
        """Bytes of the whole blob."""
        return self.header_len + self.payload_len


@dataclass(frozen=True, slots=True, kw_only=True)
class _HeaderFields:
    """Everything a header says, before authentication (also used by tests to forge one)."""

    dtype_code: int
    compression_id: int
    key: bytes
    parent_key: bytes
    owner: bytes
    num_tokens: int
    tokens: bytes
    num_layers: int
    kv_heads: int
    block_tokens: int
    head_dim: int
    payload_len: int
    raw_len: int
    checksum: bytes
    namespace_digest: bytes


def _pack_header(fields: _HeaderFields, mac_key: bytes, *, version: int = FORMAT_VERSION) -> bytes:
    """Prefix, fields and MAC of one blob (the payload follows it)."""
    variable = fields.key + fields.parent_key + fields.owner + fields.tokens
    header_len = PREFIX_LEN + _FIELDS.size + len(variable) + MAC_LEN
    body = b"".join(
        (
            _PREFIX.pack(MAGIC, version, header_len),
            _FIELDS.pack(
                fields.dtype_code,
                fields.compression_id,
                len(fields.key),
                len(fields.parent_key),
                len(fields.owner),
                fields.num_tokens,
                fields.num_layers,
                fields.kv_heads,
                fields.block_tokens,
                fields.head_dim,
                fields.payload_len,
                fields.raw_len,
                fields.checksum,
                fields.namespace_digest,
            ),
            variable,
        )
    )
    mac = hashlib.blake2b(body, key=mac_key, digest_size=MAC_LEN).digest()
    return body + mac


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
        mac_key: key of the header MAC (``derive_mac_key``), 16..64 bytes.
        layout: the model's KV layout; every block must match it.
        block_tokens: tokens per block.
        compression: "raw" (default: lz4 saves only 1-1.5% on real KV), "lz4", or "auto"
            (lz4 kept only where it saves at least ``min_lz4_saving`` of the raw size).
        min_lz4_saving: fraction of the raw size that "auto" needs lz4 to save.

    Raises:
        TierConfigError: a bad argument, a dtype without a format code, or a big-endian host
            (the payload is native tensor bytes, defined little-endian).
    """

    def __init__(
        self,
        *,
        mac_key: bytes,
        layout: KVLayout,
        block_tokens: int,
        compression: CompressionMode = "raw",
        min_lz4_saving: float = 0.05,
    ) -> None:
        if sys.byteorder != "little":
            raise TierConfigError(
                "the block codec stores native tensor bytes as little-endian and cannot run on "
                f"a {sys.byteorder}-endian host"
            )
        if not 16 <= len(mac_key) <= 64:
            raise TierConfigError(f"mac_key must be 16 to 64 bytes long, got {len(mac_key)}")
        if block_tokens < 1:
            raise TierConfigError(f"block_tokens must be >= 1, got {block_tokens}")
        if layout.dtype not in _DTYPE_TO_CODE:
            raise TierConfigError(
                f"KV dtype {layout.dtype} has no block format code; supported: "
                + ", ".join(str(d) for d in _DTYPE_TO_CODE)
            )
        if compression not in _COMPRESSION_MODES:
            raise TierConfigError(
                f"unknown compression {compression!r}; expected one of {list(_COMPRESSION_MODES)}"
            )
        if not 0.0 <= min_lz4_saving < 1.0:
            raise TierConfigError(f"min_lz4_saving must be in [0, 1), got {min_lz4_saving}")
        if 4 * block_tokens + 2 * MAX_KEY_LEN + MAX_OWNER_BYTES + _MIN_HEADER_LEN > MAX_HEADER_LEN:
            raise TierConfigError(f"block_tokens {block_tokens} is too large for a block header")
        self._mac_key = mac_key
        self._layout = layout
        self._block_tokens = block_tokens
        self._compression: CompressionMode = compression
        self._min_lz4_saving = min_lz4_saving
        self._dtype_code = _DTYPE_TO_CODE[layout.dtype]
        self._raw_len = layout.block_nbytes(block_tokens)
        # lz4 frames of incompressible data grow by a few bytes per 64 KiB block plus the frame
        # header; anything beyond this bound is not an lz4 frame of raw_len bytes.
        self._max_lz4_len = self._raw_len + self._raw_len // 255 + 1024
        # NOTE: keying BLAKE2b costs a compression; copying a keyed state is cheaper.
        self._mac_state = hashlib.blake2b(key=mac_key, digest_size=MAC_LEN)

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

    # ----------------------------------------------------------------------------- encode

    def encode(self, meta: BlockMeta, block: KVBlock) -> bytes:
        """Serialise ``block`` with its identity ``meta`` into one authenticated blob.

        The block's tensors may live on any device and need not be contiguous; they are read,
        never modified.

        Raises:
            CodecError: ``meta`` or ``block`` does not fit the format or the codec's layout
                (reason "key", "parent", "namespace", "tokens", "size" or "shape").
        """
        self._check_meta_for_encode(meta)
        try:
            block.check(self._layout, self._block_tokens)
        except PayloadError as exc:
            raise CodecError("shape", f"cannot encode block: {exc}") from exc
        chunks = [
            self._tensor_bytes(t) for kv in zip(block.keys, block.values, strict=True) for t in kv
        ]

        compression: Compression = "raw"
        payload: bytes | None = None
        if self._compression != "raw":
            raw = b"".join(chunks)
            packed: bytes = lz4.frame.compress(raw, store_size=True)
            saving = len(raw) - len(packed)
            if self._compression == "lz4" or saving >= self._min_lz4_saving * len(raw):
                compression, payload = "lz4", packed
            else:
                payload = raw
        if payload is None:
            hasher = xxhash.xxh3_128()
            for chunk in chunks:
                hasher.update(chunk)
            checksum: bytes = hasher.digest()
            payload_len = self._raw_len
        else:
            checksum = xxhash.xxh3_128_digest(payload)
            payload_len = len(payload)

        header = _pack_header(
            _HeaderFields(
                dtype_code=self._dtype_code,
                compression_id=_COMPRESSION_TO_ID[compression],
                key=bytes(meta.key),
                parent_key=bytes(meta.parent_key),
                owner=meta.owner.encode("utf-8"),
                num_tokens=len(meta.tokens) // 4,
                tokens=bytes(meta.tokens),
                num_layers=self._layout.num_layers,
                kv_heads=self._layout.kv_heads,
                block_tokens=self._block_tokens,
                head_dim=self._layout.head_dim,
                payload_len=payload_len,
                raw_len=self._raw_len,
                checksum=checksum,
                namespace_digest=bytes(meta.namespace_digest),
            ),
            self._mac_key,
        )
        # One copy of the tensor bytes: straight from the tensors into the result.
        if payload is None:
            return b"".join([header, *chunks])
        return header + payload

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

    @staticmethod
    def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
        """A flat byte view of the tensor, copied only if it is not on the CPU or not
        contiguous (the view keeps its tensor alive)."""
        cpu = tensor.detach().to("cpu").contiguous()
        return cpu.view(torch.uint8).numpy().reshape(-1).data

    # ----------------------------------------------------------------------------- decode

    @staticmethod
    def header_length(prefix: bytes | memoryview) -> int:
        """The header length (bytes before the payload) read from the first PREFIX_LEN bytes.

        Raises:
            CodecError: fewer than PREFIX_LEN bytes ("truncated"), another magic ("magic") or
                format version ("version"), or a length out of bounds ("size").
        """
        view = _as_byte_view(prefix)
        if len(view) < PREFIX_LEN:
            raise CodecError(
                "truncated", f"block truncated: {len(view)} of at least {PREFIX_LEN} bytes"
            )
        magic, version, header_len = _PREFIX.unpack_from(view, 0)
        if magic != MAGIC:
            raise CodecError("magic", f"not a kvgate block: magic {bytes(magic)!r}, want {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise CodecError(
                "version", f"block format version {version}, this build reads {FORMAT_VERSION}"
            )
        if not _MIN_HEADER_LEN <= header_len <= MAX_HEADER_LEN:
            raise CodecError(
                "size",
                f"block header claims {header_len} bytes, "
                f"outside [{_MIN_HEADER_LEN}, {MAX_HEADER_LEN}]",
            )
        return int(header_len)

    def read_header(self, data: bytes | bytearray | memoryview) -> DecodedHeader:
        """Authenticate and check the header at the start of ``data`` (the payload may be
        absent: only the first ``header_len`` bytes are read).

        Raises:
            CodecError: reasons "truncated", "magic", "version", "size", "mac", "codec",
                "shape".
        """
        view = _as_byte_view(data)
        header_len = self.header_length(view[:PREFIX_LEN])
        if len(view) < header_len:
            raise CodecError(
                "truncated", f"block truncated: {len(view)} of {header_len} header bytes"
            )
        mac_at = header_len - MAC_LEN
        state = self._mac_state.copy()
        state.update(view[:mac_at])
        if not hmac.compare_digest(state.digest(), view[mac_at:header_len]):
            raise CodecError(
                "mac", "MAC mismatch: written with another deployment secret or tampered"
            )
        try:
            return self._parse_fields(view, header_len)
        except (struct.error, IndexError, ValueError, OverflowError) as exc:
            # NOTE: unreachable for headers this codec wrote; a forged header that passed the
            # MAC is a leaked key, but it must still fail as a CodecError, never a crash.
            raise CodecError("codec", f"malformed block header: {exc}") from exc

    def _parse_fields(self, view: memoryview, header_len: int) -> DecodedHeader:
        (
            dtype_code,
            compression_id,
            key_len,
            parent_len,
            owner_len,
            num_tokens,
            num_layers,
            kv_heads,
            block_tokens,
            head_dim,
            payload_len,
            raw_len,
            checksum,
            namespace_digest,
        ) = _FIELDS.unpack_from(view, PREFIX_LEN)
        want_len = (
            PREFIX_LEN + _FIELDS.size + key_len + parent_len + owner_len + 4 * num_tokens + MAC_LEN
        )
        if want_len != header_len:
            raise CodecError(
                "size", f"block header fields need {want_len} bytes, the prefix says {header_len}"
            )
        if not 1 <= key_len <= MAX_KEY_LEN or parent_len > MAX_KEY_LEN:
            raise CodecError(
                "size", f"block header key lengths {key_len}/{parent_len} out of bounds"
            )
        if owner_len > MAX_OWNER_BYTES:
            raise CodecError("size", f"block header owner of {owner_len} bytes is too long")

        dtype = _CODE_TO_DTYPE.get(dtype_code)
        if dtype is None:
            raise CodecError("codec", f"unknown dtype code {dtype_code} in block header")
        layout = self._layout
        stored = (dtype, num_layers, kv_heads, block_tokens, head_dim, num_tokens)
        wanted = (
            layout.dtype,
            layout.num_layers,
            layout.kv_heads,
            self._block_tokens,
            layout.head_dim,
            self._block_tokens,
        )
        if stored != wanted:
            raise CodecError(
                "shape",
                "block layout (dtype, layers, kv_heads, block_tokens, head_dim, tokens) "
                f"{_fmt(stored)} differs from the model's {_fmt(wanted)}",
            )
        compression = _ID_TO_COMPRESSION.get(compression_id)
        if compression is None:
            raise CodecError("codec", f"unknown compression id {compression_id} in block header")
        if raw_len != self._raw_len:
            raise CodecError(
                "size", f"block header claims {raw_len} raw bytes, the layout has {self._raw_len}"
            )
        max_payload = self._raw_len if compression == "raw" else self._max_lz4_len
        min_payload = self._raw_len if compression == "raw" else 1
        if not min_payload <= payload_len <= max_payload:
            raise CodecError(
                "size",
                f"block header claims a {compression} payload of {payload_len} bytes; "
                f"a {self._raw_len}-byte block allows {min_payload}..{max_payload}",
            )

        at = PREFIX_LEN + _FIELDS.size
        key = bytes(view[at : at + key_len])
        at += key_len
        parent_key = bytes(view[at : at + parent_len])
        at += parent_len
        try:
            owner = str(view[at : at + owner_len], "utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError("codec", f"block owner is not valid utf-8: {exc}") from exc
        at += owner_len
        tokens = bytes(view[at : at + 4 * num_tokens])
        meta = BlockMeta(
            key=BlockKey(key),
            parent_key=BlockKey(parent_key),
            namespace_digest=bytes(namespace_digest),
            owner=owner,
            tokens=tokens,
        )
        return DecodedHeader(
            meta=meta,
            dtype=dtype,
            num_layers=num_layers,
            kv_heads=kv_heads,
            block_tokens=block_tokens,
            head_dim=head_dim,
            compression=compression,
            payload_len=payload_len,
            raw_len=raw_len,
            checksum=bytes(checksum),
            header_len=header_len,
        )

    def decode(self, data: bytes | bytearray | memoryview, expected: BlockMeta) -> KVBlock:
        """Verify ``data`` as the encoding of the block ``expected`` and return its tensors.

        The returned tensors own their memory (one buffer for the whole block): the caller may
        reuse or release ``data`` at once.

        NOTE: the identity is compared before the checksum and decompression, so a foreign
        block costs no payload work; every check runs either way, only the reported reason of
        a blob that is wrong twice depends on the order.

        Raises:
            CodecError: any reason of ``read_header``, or "truncated"/"size" (total length),
                "key", "parent", "namespace", "tokens" (not the expected block), "checksum",
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

        payload = view[header.header_len :]
        if not hmac.compare_digest(xxhash.xxh3_128_digest(payload), header.checksum):
            raise CodecError("checksum", "payload checksum mismatch: block corrupted")

        if header.compression == "lz4":
            flat = torch.frombuffer(self._decompress(payload), dtype=torch.uint8)
        else:
            flat = torch.empty(self._raw_len, dtype=torch.uint8)
            np.copyto(flat.numpy(), np.frombuffer(payload, dtype=np.uint8))

        layout = self._layout
        per_layer = flat.view(layout.dtype).view(
            layout.num_layers, 2, layout.kv_heads, self._block_tokens, layout.head_dim
        )
        layers = per_layer.unbind(0)
        return KVBlock(
            keys=tuple(layer[0] for layer in layers),
            values=tuple(layer[1] for layer in layers),
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


def _fmt(fields: tuple[object, ...]) -> str:
    return "(" + ", ".join(str(f).removeprefix("torch.") for f in fields) + ")"
