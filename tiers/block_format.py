"""The byte layout of a stored block's header, and the checks a header passes before it is used.

Format 3 (all integers little-endian)::

    prefix  (PREFIX_LEN = 10)
      0   4s   MAGIC b"KVGB"
      4   u16  format version (FORMAT_VERSION)
      6   u32  header length: bytes before the payload (prefix + fields + both tags)
    fields  (fixed part, 90 bytes)
      10  u8   dtype code (``_dtype_table``), or a quantized format's code
                   (``QUANTIZATION_TO_CODE``: its payload is ``tiers.payload_format``'s)
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
      52  u64  TTL in milliseconds (sliding; 0: none)
      60  u64  expiry as of writing, Unix milliseconds (0: none -- no TTL, or pinned)
      68  32s  namespace digest
    fields  (variable part)
      100      key, parent key, owner (utf-8), tokens (u32 each)
    block tag   32 bytes: keyed BLAKE3 of everything before it, then the payload
    header tag  32 bytes: keyed BLAKE3 of everything before it (``tiers.block_mac``)
    payload for each layer: K bytes then V bytes, each [kv_heads, block_tokens, head_dim]
            C-contiguous; optionally one lz4 frame of those bytes

Format 1 (until 2026-11) had a keyed BLAKE2b over the header only and an xxh3-128 of the payload
in the header, which a writer can forge (``tiers.block_mac``). Format 2 had today's MACs but no
expiry: a block that left the process lost its TTL. Blocks of both are refused with reason
"version" -- counted, deleted and recomputed, never an error.

The expiry fields (``tiers.base.BlockExpiry``) sit inside the authenticated header: whoever can
write Redis or the disk cannot extend a block's life without the deployment secret.

Checks happen cheapest first and before any allocation that a header could inflate: the prefix
(magic, version, header length within ``MAX_HEADER_LEN``), the header tag, then the fields
against the layout (``parse_fields``). Shapes and sizes are compared with the model's
``KVLayout``, never taken from the header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Literal

import torch

from gateway.core.quantization import Quantization
from policies.base import BlockKey
from tiers.base import BlockExpiry, BlockMeta, CodecError
from tiers.block_mac import MAC_LEN
from tiers.payload import KVLayout

FORMAT_VERSION: int = 3
MAGIC: bytes = b"KVGB"

_PREFIX = struct.Struct("<4sHI")
PREFIX_LEN: int = _PREFIX.size
"""Bytes at the start of every blob from which ``header_length`` reads the header length (disk
recovery reads this much, then the header, never the payload)."""

_FIELDS = struct.Struct("<BBBBHIIIIIQQQQ32s")
TAGS_LEN: int = 2 * MAC_LEN
"""The block tag then the header tag, the last bytes of every header."""
NAMESPACE_DIGEST_LEN = 32
MAX_KEY_LEN = 64
MAX_OWNER_BYTES = 256
MAX_HEADER_LEN = 1 << 20
"""Upper bound on any header (about 260k tokens per block); a longer claim is refused unread."""

MIN_HEADER_LEN = PREFIX_LEN + _FIELDS.size + 1 + TAGS_LEN

Compression = Literal["raw", "lz4"]

COMPRESSION_TO_ID: dict[Compression, int] = {"raw": 0, "lz4": 1}
_ID_TO_COMPRESSION: dict[int, Compression] = {v: k for k, v in COMPRESSION_TO_ID.items()}


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


CODE_TO_DTYPE: dict[int, torch.dtype] = _dtype_table()
DTYPE_TO_CODE: dict[torch.dtype, int] = {v: k for k, v in CODE_TO_DTYPE.items()}

QUANTIZATION_TO_CODE: dict[Quantization, int] = {"int8": 64, "fp8": 65}
"""Codes of the quantized payload formats, in the dtype byte but apart from every dtype code:
a quantized blob never reads as a tensor of plain int8 or fp8 K/V, nor the other way round.
Part of the format: never reused."""
CODE_TO_QUANTIZATION: dict[int, Quantization] = {v: k for k, v in QUANTIZATION_TO_CODE.items()}


def format_name(code: int) -> str:
    """What a dtype/format code stands for, for messages."""
    if code in CODE_TO_QUANTIZATION:
        return f"{CODE_TO_QUANTIZATION[code]}-quantized"
    return str(CODE_TO_DTYPE[code]).removeprefix("torch.")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedHeader:
    """A header that passed the header tag and the layout checks (the payload is not checked:
    only ``BlockCodec.decode`` checks the block tag over header and payload).

    Attributes:
        meta: the identity stored with the block.
        dtype, num_layers, kv_heads, block_tokens, head_dim: the stored layout (equal to the
            codec's, or the header would have been refused); ``dtype`` is the K/V dtype the
            block decodes to.
        quantization: None for an exact payload, else the lossy format it is stored in.
        compression: "raw" or "lz4".
        payload_len: stored payload bytes.
        raw_len: payload bytes after decompression.
        block_tag: the keyed BLAKE3 over the header before it and the payload.
        header_len: bytes before the payload (prefix + fields + tags).
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
    block_tag: bytes
    header_len: int
    quantization: Quantization | None = None

    @property
    def total_len(self) -> int:
        """Bytes of the whole blob."""
        return self.header_len + self.payload_len

    @property
    def body_len(self) -> int:
        """Bytes of the header before its tags: what the block tag covers ahead of the payload."""
        return self.header_len - TAGS_LEN


@dataclass(frozen=True, slots=True, kw_only=True)
class HeaderFields:
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
    namespace_digest: bytes
    ttl_ms: int = 0
    expires_at_ms: int = 0


def expiry_fields(expiry: BlockExpiry | None) -> tuple[int, int]:
    """``(ttl_ms, expires_at_ms)`` of an expiry, 0 standing for None."""
    if expiry is None:
        return 0, 0
    ttl_ms = 0 if expiry.ttl_s is None else max(1, round(expiry.ttl_s * 1000))
    expires_ms = 0 if expiry.expires_at is None else max(1, round(expiry.expires_at * 1000))
    return ttl_ms, expires_ms


def expiry_of(ttl_ms: int, expires_at_ms: int) -> BlockExpiry | None:
    """The expiry a header's two fields say (None: never expires)."""
    if not ttl_ms and not expires_at_ms:
        return None
    return BlockExpiry(ttl_s=ttl_ms / 1000 if ttl_ms else None,
                       expires_at=expires_at_ms / 1000 if expires_at_ms else None)


def pack_body(fields: HeaderFields, *, version: int = FORMAT_VERSION) -> bytes:
    """Prefix and fields of one header: everything before its two tags."""
    variable = fields.key + fields.parent_key + fields.owner + fields.tokens
    header_len = PREFIX_LEN + _FIELDS.size + len(variable) + TAGS_LEN
    return b"".join(
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
                fields.ttl_ms,
                fields.expires_at_ms,
                fields.namespace_digest,
            ),
            variable,
        )
    )


def header_length(view: memoryview) -> int:
    """The header length read from the first PREFIX_LEN bytes of ``view``.

    Raises:
        CodecError: fewer than PREFIX_LEN bytes ("truncated"), another magic ("magic") or
            format version ("version": format 1 blocks land here), or a length out of bounds
            ("size").
    """
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
    if not MIN_HEADER_LEN <= header_len <= MAX_HEADER_LEN:
        raise CodecError(
            "size",
            f"block header claims {header_len} bytes, outside [{MIN_HEADER_LEN}, {MAX_HEADER_LEN}]",
        )
    return int(header_len)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedShape:
    """What every header read by one codec must say about shapes and sizes."""

    layout: KVLayout
    block_tokens: int
    raw_len: int
    max_lz4_len: int
    format_code: int = 0
    """The dtype/format byte every header must carry (0: the layout dtype's own code)."""

    def expected_code(self) -> int:
        return self.format_code or DTYPE_TO_CODE[self.layout.dtype]


def parse_fields(view: memoryview, header_len: int, shape: ExpectedShape) -> DecodedHeader:
    """Parse and check the fields of an authenticated header of ``header_len`` bytes.

    Raises:
        CodecError: reasons "size", "codec", "shape"; struct, unicode and index errors of a
            header forged with a leaked key are the caller's to translate.
    """
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
        ttl_ms,
        expires_at_ms,
        namespace_digest,
    ) = _FIELDS.unpack_from(view, PREFIX_LEN)
    want_len = (
        PREFIX_LEN + _FIELDS.size + key_len + parent_len + owner_len + 4 * num_tokens + TAGS_LEN
    )
    if want_len != header_len:
        raise CodecError(
            "size", f"block header fields need {want_len} bytes, the prefix says {header_len}"
        )
    if not 1 <= key_len <= MAX_KEY_LEN or parent_len > MAX_KEY_LEN:
        raise CodecError("size", f"block header key lengths {key_len}/{parent_len} out of bounds")
    if owner_len > MAX_OWNER_BYTES:
        raise CodecError("size", f"block header owner of {owner_len} bytes is too long")

    if dtype_code not in CODE_TO_DTYPE and dtype_code not in CODE_TO_QUANTIZATION:
        raise CodecError("codec", f"unknown dtype code {dtype_code} in block header")
    layout = shape.layout
    want_code = shape.expected_code()
    if dtype_code != want_code:
        # An exact tier reading a quantized blob, or the other way round, lands here too.
        raise CodecError(
            "shape", f"block holds {format_name(dtype_code)} K/V, this tier reads "
                     f"{format_name(want_code)}")
    stored = (layout.dtype, num_layers, kv_heads, block_tokens, head_dim, num_tokens)
    wanted = (
        layout.dtype,
        layout.num_layers,
        layout.kv_heads,
        shape.block_tokens,
        layout.head_dim,
        shape.block_tokens,
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
    if raw_len != shape.raw_len:
        raise CodecError(
            "size", f"block header claims {raw_len} raw bytes, the layout has {shape.raw_len}"
        )
    max_payload = shape.raw_len if compression == "raw" else shape.max_lz4_len
    min_payload = shape.raw_len if compression == "raw" else 1
    if not min_payload <= payload_len <= max_payload:
        raise CodecError(
            "size",
            f"block header claims a {compression} payload of {payload_len} bytes; "
            f"a {shape.raw_len}-byte block allows {min_payload}..{max_payload}",
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
    body_len = header_len - TAGS_LEN
    return DecodedHeader(
        meta=BlockMeta(
            key=BlockKey(key),
            parent_key=BlockKey(parent_key),
            namespace_digest=bytes(namespace_digest),
            owner=owner,
            tokens=tokens,
            expiry=expiry_of(ttl_ms, expires_at_ms),
        ),
        dtype=layout.dtype,
        num_layers=num_layers,
        kv_heads=kv_heads,
        block_tokens=block_tokens,
        head_dim=head_dim,
        compression=compression,
        payload_len=payload_len,
        raw_len=raw_len,
        block_tag=bytes(view[body_len : body_len + MAC_LEN]),
        header_len=header_len,
        quantization=CODE_TO_QUANTIZATION.get(dtype_code),
    )


def _fmt(fields: tuple[object, ...]) -> str:
    return "(" + ", ".join(str(f).removeprefix("torch.") for f in fields) + ")"
