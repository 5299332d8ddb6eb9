"""Each lower tier's load bandwidth, measured once at start-up with blocks of the model's shape.

Why: the cache loads a block from disk or Redis only where that is no slower than recomputing
it (``tiers.hierarchy``, ``worth_loading``), and before a tier's first load it has no figure to
judge by. A disk tier was read one block first, but Redis was read a whole chain first (one
block's time is mostly the round trip a pipelined chain pays once): on an H100 an 8B model's
first Redis hit of an 8k-token chain loaded for 1.7 s where recomputing took 0.33 s
(docs/gpu.md). Measured at start-up, the first hit on either tier is judged like every later
one.

How: ``MEASURE_BYTES`` of blocks of random K/V (their dtype, their shape) are written to the tier
under random keys in a namespace of their own, read back the way a hit reads them (through the
hierarchy, decoded into the device tier's pages where the pool has room, so the figure includes
verification and the copy up), and deleted. The hierarchy times that read as it times every
load (``TierHierarchy.read_many``, ``fetch_remote``), so the measurement is its first sample;
later loads refine it. The blocks carry a one-minute expiry, so that a replica stopped halfway
leaves nothing served: a disk tier's recovery and Redis both drop them once expired. They are
counted in the tier's puts, hits and deletes like any other block.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gateway.core.fingerprint import KEY_BYTES, NAMESPACE_DIGEST_BYTES, ROOT_PARENT, Scope
from policies.base import BlockKey
from tiers.base import BlockExpiry, BlockMeta
from tiers.disk import DiskStore
from tiers.hierarchy import REMOTE, TierHierarchy
from tiers.payload import KVBlock, KVLayout

logger = logging.getLogger(__name__)

MEASURE_BYTES = 32 << 20
"""Bytes read from each tier: enough that the round trip and per-call costs are a small part of
the time (as they are of a real chain's), little enough to take well under a second."""

MAX_BLOCKS = 16
"""At most this many blocks (a small model's blocks are small: their count, not their bytes,
would make the measurement long)."""

EXPIRY_S = 60.0
"""The measurement's blocks expire this long after they were written, should they outlive it."""


@dataclass(frozen=True, slots=True)
class MeasuredLoad:
    """One tier's start-up measurement: ``num_blocks`` blocks read back, or none (``reason``)."""

    tier: str
    num_blocks: int
    num_bytes: int
    bytes_per_s: float | None
    reason: str = ""

    def describe(self) -> str:
        if self.bytes_per_s is None:
            return f"{self.tier}: not measured ({self.reason})"
        return (f"{self.tier}: {self.bytes_per_s / 1e6:,.0f} MB/s "
                f"({self.num_blocks} blocks, {self.num_bytes / 2**20:.1f} MiB)")


def measure_load_bandwidths(hierarchy: TierHierarchy, layout: KVLayout, *, block_tokens: int,
                            into_tier: str, target_bytes: int = MEASURE_BYTES,
                            max_blocks: int = MAX_BLOCKS, seed: int = 0) -> list[MeasuredLoad]:
    """Measure the disk tier and the remote one (Redis), those ``hierarchy`` has, in place.

    Memory tiers are not measured: a load from memory is never slower than recomputing. A
    tier's figure is recorded in ``hierarchy`` (its first load sample); the result says what
    was found, for the start-up log. ``into_tier``: the tier hits are read into (the first).
    """
    block_bytes = layout.block_nbytes(block_tokens)
    num_blocks = max(1, min(max_blocks, target_bytes // block_bytes))
    blocks = _random_blocks(layout, block_tokens, num_blocks, seed)
    results = []
    for tier in hierarchy.names:
        if isinstance(hierarchy.store(tier), DiskStore):
            results.append(_measure_disk(hierarchy, tier, blocks, into_tier, block_tokens))
    if hierarchy.remote is not None:
        results.append(_measure_remote(hierarchy, blocks, into_tier, block_tokens))
    return results


def _measure_disk(hierarchy: TierHierarchy, tier: str, blocks: list[KVBlock], into_tier: str,
                  block_tokens: int) -> MeasuredLoad:
    store = hierarchy.store(tier)
    assert isinstance(store, DiskStore)
    metas = _metas(len(blocks), block_tokens)
    for meta, block in zip(metas, blocks, strict=True):
        store.put(meta, block)
    try:
        if not store.flush(timeout_s=30.0):
            return MeasuredLoad(tier, 0, 0, None, "its writes did not finish in 30 s")
        got = hierarchy.read_many(tier, metas, into_tier=into_tier)
        return _result(hierarchy, tier, got)
    finally:
        for meta in metas:
            store.delete(meta.key)


def _measure_remote(hierarchy: TierHierarchy, blocks: list[KVBlock], into_tier: str,
                    block_tokens: int) -> MeasuredLoad:
    remote = hierarchy.remote
    assert remote is not None
    metas = _metas(len(blocks), block_tokens)
    remote.put_many(list(zip(metas, blocks, strict=True)))
    try:
        got = [block for block, _ in hierarchy.fetch_remote(metas, into_tier=into_tier)]
        return _result(hierarchy, REMOTE, got)
    finally:
        remote.delete_metas(metas)


def _result(hierarchy: TierHierarchy, tier: str,
            got: Sequence[KVBlock | None]) -> MeasuredLoad:
    read = [block for block in got if block is not None]
    if not read:
        return MeasuredLoad(tier, 0, 0, None, "no block written could be read back; its "
                            "first hits are measured instead")
    return MeasuredLoad(tier, len(read), sum(block.nbytes for block in read),
                        hierarchy.bandwidth(tier))


def _random_blocks(layout: KVLayout, block_tokens: int, count: int,
                   seed: int) -> list[KVBlock]:
    """Blocks of normal values (a real K/V's bytes do not compress either)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, 2, layout.kv_heads, block_tokens, layout.head_dim)
    return [KVBlock.of_packed(torch.randn(shape, generator=generator).to(layout.dtype))
            for _ in range(count)]


def _metas(count: int, block_tokens: int) -> list[BlockMeta]:
    """A chain of ``count`` blocks under random keys in a random namespace of its own."""
    namespace = os.urandom(NAMESPACE_DIGEST_BYTES)
    expiry = BlockExpiry(ttl_s=EXPIRY_S, expires_at=time.time() + EXPIRY_S)
    tokens = bytes(4 * block_tokens)
    metas: list[BlockMeta] = []
    parent = ROOT_PARENT
    for _ in range(count):
        key = BlockKey(os.urandom(KEY_BYTES))
        metas.append(BlockMeta(key=key, parent_key=parent, namespace_digest=namespace,
                               owner=Scope.shared().owner, tokens=tokens, expiry=expiry))
        parent = key
    return metas
