"""The attack that format 1 of the block codec fell to, and format 1 itself, for tests.

Format 1 MAC'd the header (keyed BLAKE2b) and guarded the payload with an xxh3-128 stored in
that header. xxh3 is no MAC. For inputs over 240 bytes it runs 8 64-bit accumulators over
64-byte stripes; each 8-byte word ``v`` in lane ``i`` of a stripe does

    acc[i ^ 1] += v
    acc[i]     += lo32(v ^ k) * hi32(v ^ k)      (k: 8 bytes of a public, fixed secret)

and the accumulators are only scrambled between 1 KiB blocks (16 stripes). Inside one block
every accumulator is therefore a plain sum of per-word terms. A word whose ``v ^ k`` has a zero
half adds nothing to the product sum and only ``v`` to its neighbour's sum, and two such words
(one with the low half free, one with the high half free) can add any 64-bit value. So a
forger writes chosen bytes into 14 of every 16 words per lane and solves the other 2 so that
every accumulator ends each block exactly as before: the digest, and format 1's check, hold.

``forge_keeping_xxh3`` does that for any payload whose length is a multiple of 64 (KV always
is); ``encode_format_1`` and ``format_1_accepts`` rebuild format 1's writer and its
authentication steps (header MAC, then the payload checksum) so that a test can show the old
scheme accepting the forgery that the current codec refuses.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import torch
import xxhash

from tiers.base import BlockMeta
from tiers.block_format import DTYPE_TO_CODE, MAGIC
from tiers.codec import BlockCodec
from tiers.payload import KVBlock

# kSecret of the xxHash reference implementation: a constant of the algorithm, public.
XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1c" "ded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221" "b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea3" "71644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d" "8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb" "170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce" "45cb3a8f95160428afd7fbcabb4b407e"
)
_STRIPE = 64
_BLOCK = 1024  # 16 stripes: (len(secret) - 64) / 8
_LAST_STRIPE_SECRET_OFFSET = len(XXH3_SECRET) - _STRIPE - 7
_M64 = (1 << 64) - 1
_M32 = (1 << 32) - 1
_FIX_STRIPES = (0, 1)
"""Stripes of each segment whose words are solved; every other word is the forger's choice."""


def _word(data: bytes | bytearray, at: int) -> int:
    return int.from_bytes(data[at : at + 8], "little")


def _product(word: int, key: int) -> int:
    mixed = word ^ key
    return (mixed & _M32) * (mixed >> 32)


def _segments(length: int) -> list[list[tuple[int, int]]]:
    """(input offset, secret offset) of each stripe, grouped by the scrambles between them."""
    num_blocks = (length - 1) // _BLOCK
    segments = [[(b * _BLOCK + s * _STRIPE, s * 8) for s in range(16)] for b in range(num_blocks)]
    base = num_blocks * _BLOCK
    num_stripes = ((length - 1) - base) // _STRIPE
    last = [(base + s * _STRIPE, s * 8) for s in range(num_stripes)]
    segments.append([*last, (length - _STRIPE, _LAST_STRIPE_SECRET_OFFSET)])
    return segments


def _gain(data: bytes | bytearray, stripes: list[tuple[int, int]], lane: int) -> int:
    """What the words of ``stripes`` add to accumulator ``lane`` (modulo 2**64 later)."""
    total = 0
    for at, secret_at in stripes:
        total += _product(_word(data, at + 8 * lane), _word(XXH3_SECRET, secret_at + 8 * lane))
        total += _word(data, at + 8 * (lane ^ 1))
    return total


def forge_keeping_xxh3(original: bytes, chosen: bytes) -> tuple[bytes, float]:
    """A payload equal to ``chosen`` except two words per lane per segment, with the xxh3-128
    (seed 0, default secret) of ``original``.

    Returns:
        The forged payload and the fraction of its bytes that equal ``chosen``.
    """
    length = len(original)
    assert length == len(chosen) and length > 240 and length % _STRIPE == 0
    forged = bytearray(chosen)
    for segment in _segments(length):
        assert len(segment) > len(_FIX_STRIPES)
        fix = [segment[i] for i in _FIX_STRIPES]
        free = [stripe for i, stripe in enumerate(segment) if i not in _FIX_STRIPES]
        for lane in range(8):
            other = lane ^ 1
            # acc[lane] must gain what the original's segment gave it; the fix words of lane
            # `other` add nothing to acc[other] (zero product) and their sum to acc[lane].
            need = (_gain(original, segment, lane) - _gain(forged, free, lane)) & _M64
            (p_at, p_secret), (q_at, q_secret) = fix
            p_key = _word(XXH3_SECRET, p_secret + 8 * other)
            q_key = _word(XXH3_SECRET, q_secret + 8 * other)
            low = (need - (q_key & _M32)) & _M32  # p: high half = p_key's, low half free
            carry = ((low + (q_key & _M32)) >> 32) & 1
            high = ((need >> 32) - (p_key >> 32) - carry) & _M32  # q: low = q_key's, high free
            p_word = (p_key & ~_M32 & _M64) | low
            q_word = (high << 32) | (q_key & _M32)
            assert _product(p_word, p_key) == 0 and _product(q_word, q_key) == 0
            assert (p_word + q_word) & _M64 == need
            forged[p_at + 8 * other : p_at + 8 * other + 8] = p_word.to_bytes(8, "little")
            forged[q_at + 8 * other : q_at + 8 * other + 8] = q_word.to_bytes(8, "little")
    same = sum(1 for a, b in zip(forged, chosen, strict=True) if a == b)
    return bytes(forged), same / length


# ----------------------------------------------------------------------------- format 1

_V1_FIELDS = struct.Struct("<BBBBHIIIIIQQ16s32s")
_V1_PREFIX = struct.Struct("<4sHI")
_V1_MAC_LEN = 32
_V1_CHECKSUM_AT = _V1_PREFIX.size + 42  # the xxh3-128 field of the fixed part


def encode_format_1(codec: BlockCodec, mac_key: bytes, meta: BlockMeta, block: KVBlock) -> bytes:
    """The raw blob format 1 wrote for ``block`` (header MAC'd, payload xxh3-checked)."""
    payload = b"".join(
        t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for kv in zip(block.keys, block.values, strict=True)
        for t in kv
    )
    layout = codec.layout
    variable = bytes(meta.key) + bytes(meta.parent_key) + meta.owner.encode() + meta.tokens
    header_len = _V1_PREFIX.size + _V1_FIELDS.size + len(variable) + _V1_MAC_LEN
    body = (
        _V1_PREFIX.pack(MAGIC, 1, header_len)
        + _V1_FIELDS.pack(
            DTYPE_TO_CODE[layout.dtype],
            0,
            len(meta.key),
            len(meta.parent_key),
            len(meta.owner.encode()),
            len(meta.tokens) // 4,
            layout.num_layers,
            layout.kv_heads,
            codec.block_tokens,
            layout.head_dim,
            len(payload),
            len(payload),
            xxhash.xxh3_128_digest(payload),
            meta.namespace_digest,
        )
        + variable
    )
    mac = hashlib.blake2b(body, key=mac_key, digest_size=_V1_MAC_LEN).digest()
    return body + mac + payload


def format_1_accepts(blob: bytes, mac_key: bytes) -> bool:
    """Format 1's authentication of a blob: the header MAC, then the payload's xxh3-128."""
    header_len = _V1_PREFIX.unpack_from(blob)[2]
    body, mac = blob[: header_len - _V1_MAC_LEN], blob[header_len - _V1_MAC_LEN : header_len]
    if not hmac.compare_digest(hashlib.blake2b(body, key=mac_key, digest_size=32).digest(), mac):
        return False
    checksum = blob[_V1_CHECKSUM_AT : _V1_CHECKSUM_AT + 16]
    return hmac.compare_digest(xxhash.xxh3_128_digest(blob[header_len:]), checksum)
