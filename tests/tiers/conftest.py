"""Fixtures shared by the tier tests: a small KV layout, seeded blocks and metas, a codec.

Blocks and metas are pure functions of a seed (``seeded_kv_block``, ``seeded_block_meta``) so
that a subprocess, or a test after a restart, can regenerate exactly what was stored.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from policies.base import BlockKey
from tiers.base import BlockMeta
from tiers.codec import BlockCodec, derive_mac_key
from tiers.payload import KVBlock, KVLayout

TEST_SECRET = b"kvgate-tier-tests-deployment-secret"
TEST_LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
TEST_BLOCK_TOKENS = 4
TEST_NAMESPACE = hashlib.blake2b(b"tier-tests-namespace", digest_size=32).digest()


def seeded_kv_block(
    seed: int, layout: KVLayout = TEST_LAYOUT, block_tokens: int = TEST_BLOCK_TOKENS
) -> KVBlock:
    """A block of random values determined by ``seed`` (same in every process)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, layout.kv_heads, block_tokens, layout.head_dim)
    data = torch.randn(shape, generator=gen, dtype=torch.float32).to(layout.dtype)
    return KVBlock(
        keys=tuple(data[i, 0] for i in range(layout.num_layers)),
        values=tuple(data[i, 1] for i in range(layout.num_layers)),
    )


def seeded_block_meta(
    seed: int,
    *,
    block_tokens: int = TEST_BLOCK_TOKENS,
    namespace_digest: bytes = TEST_NAMESPACE,
    key_prefix: bytes = b"",
) -> BlockMeta:
    """The identity of block ``seed``: its first token is the seed, so a stored header says
    which seed it came from. ``key_prefix`` replaces the key's first bytes (to choose the
    shard directory)."""
    digest = hashlib.blake2b(struct.pack("<Q", seed) + namespace_digest, digest_size=16).digest()
    key = (key_prefix + digest[len(key_prefix) :])[:16]
    parent = hashlib.blake2b(b"parent" + digest, digest_size=16).digest()
    return BlockMeta(
        key=BlockKey(key),
        parent_key=BlockKey(parent),
        namespace_digest=namespace_digest,
        owner="tenant-a",
        tokens=struct.pack(f"<{block_tokens}I", seed, *range(1, block_tokens)),
    )


def seed_of(meta: BlockMeta) -> int:
    """The seed a ``seeded_block_meta`` was made from."""
    return int(struct.unpack_from("<I", meta.tokens)[0])


def blocks_equal(a: KVBlock, b: KVBlock) -> bool:
    """Bit for bit: every K and V tensor equal, same dtype and shape."""
    return (
        a.num_layers == b.num_layers
        and all(
            x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a.keys, b.keys, strict=True)
        )
        and all(
            x.dtype == y.dtype and torch.equal(x, y)
            for x, y in zip(a.values, b.values, strict=True)
        )
    )


def make_test_codec(
    *,
    layout: KVLayout = TEST_LAYOUT,
    block_tokens: int = TEST_BLOCK_TOKENS,
    secret: bytes = TEST_SECRET,
) -> BlockCodec:
    return BlockCodec(mac_key=derive_mac_key(secret), layout=layout, block_tokens=block_tokens)


@pytest.fixture
def block_codec() -> BlockCodec:
    """A raw codec for ``TEST_LAYOUT`` keyed by ``TEST_SECRET``."""
    return make_test_codec()
