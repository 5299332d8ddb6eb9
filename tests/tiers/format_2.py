"""Format 2 of the block codec, rebuilt for tests: today's MACs, no expiry in the header.

Format 3 added the block's TTL and expiry to the authenticated header. A format 2 block is
genuine -- MAC'd with the deployment's own key -- yet must never be served (it would come back
without its expiry, living forever): ``encode_format_2`` writes one exactly as the format 2
codec did, so tests can show that every store counts it as a "version" miss and deletes it.
"""

from __future__ import annotations

import struct

import torch

from tiers.base import BlockMeta
from tiers.block_format import DTYPE_TO_CODE, MAGIC, TAGS_LEN
from tiers.block_mac import BlockMac
from tiers.codec import BlockCodec
from tiers.payload import KVBlock

_V2_PREFIX = struct.Struct("<4sHI")
_V2_FIELDS = struct.Struct("<BBBBHIIIIIQQ32s")


def encode_format_2(codec: BlockCodec, mac_key: bytes, meta: BlockMeta, block: KVBlock) -> bytes:
    """The blob the format 2 codec wrote for ``block`` (raw payload)."""
    payload = b"".join(
        t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for kv in zip(block.keys, block.values, strict=True)
        for t in kv
    )
    layout = codec.layout
    owner = meta.owner.encode()
    variable = bytes(meta.key) + bytes(meta.parent_key) + owner + meta.tokens
    header_len = _V2_PREFIX.size + _V2_FIELDS.size + len(variable) + TAGS_LEN
    body = (
        _V2_PREFIX.pack(MAGIC, 2, header_len)
        + _V2_FIELDS.pack(
            DTYPE_TO_CODE[layout.dtype], 0, len(meta.key), len(meta.parent_key), len(owner),
            len(meta.tokens) // 4, layout.num_layers, layout.kv_heads, codec.block_tokens,
            layout.head_dim, len(payload), len(payload), meta.namespace_digest)
        + variable
    )
    mac = BlockMac(mac_key)
    block_tag = mac.block_tag(body, [payload])
    return body + block_tag + mac.header_tag(body, block_tag) + payload
