"""vLLM's KV events on the wire, and how a kvgate block becomes one.

The structs mirror ``vllm/distributed/kv_events.py`` (vllm-project/vllm) field for field, in
the same order, with the same msgspec options, so that every consumer written for vLLM decodes
kvgate's stream unchanged: the batch is a positional msgpack array ``[ts, events,
data_parallel_rank]`` (``array_like=True``), each event a msgpack map tagged by its class name
under ``"type"`` (``tag=True``; vLLM dropped ``array_like`` from the events in
vllm-project/vllm#42892, and llm-d, Dynamo and SGLang's gateway decode both since), and fields
left at their default are omitted (``omit_defaults=True``).

What kvgate puts in them:
  * ``block_hashes`` / ``parent_block_hash``: the low 64 bits of kvgate's block key, as an
    unsigned int -- what vLLM sends by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the
    low 64 bits of its SHA-256 block hash), and what every router indexes (llm-d and Dynamo
    take u64; bytes hashes are newer and not read everywhere). A prompt's first block has no
    parent (None).
  * ``medium``: "GPU" for the device tier (where requests read K/V, even on a CPU-only
    deployment: the tier a router should prefer), "CPU" for the host tier, vLLM's names. The
    disk and Redis tiers are not published: any replica can load from Redis, and disk is a
    restart's store, not a place a router should pick.
  * ``extra_keys``: on a tenant's first block, ``[(tag,)]`` where vLLM puts the request's
    ``cache_salt``, the tag an opaque per-tenant id (a keyed hash of the namespace: no key, no
    tenant name, no API key); ``[None]`` on later blocks and on the shared scope, whose blocks
    serve every tenant. Two tenants' identical prompts have different kvgate keys (and so
    different hashes) anyway; the tag is what lets a router that folds ``extra_keys`` into its
    own hash of the tokens (llm-d) keep them apart.
  * ``group_idx = 0`` and ``kv_cache_spec_kind = "full_attention"``, as vLLM sends for a model
    with one full-attention KV cache group, which is what kvgate serves.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from gateway.core.tokens import tokens_from_bytes
from policies.base import BlockKey
from tiers.base import BlockMeta
from tiers.kinds.host import HOST

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
TIER_TO_MEDIUM = {"device": MEDIUM_GPU, HOST: MEDIUM_CPU}
"""The tiers published, with vLLM's name for each; the others are not published."""
GROUP_IDX = 0
SPEC_KIND = "full_attention"
HASH_BITS = 64
TAG_DOMAIN = b"kvgate.kv-events.tenant.v1"
TAG_BYTES = 8


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One message's payload: when, what, and the data-parallel rank (kvgate has one, 0)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; encoded as a map tagged by the class name under "type"."""


class BlockStored(KVCacheEvent):
    """Blocks a medium now holds (kvgate sends one block per event)."""

    block_hashes: list[int]
    parent_block_hash: int | None
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
    """Blocks a medium no longer holds."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The publisher holds nothing any more."""


class KVEventBatch(EventBatch):
    """A batch of KV events (what a subscriber decodes)."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_hash(key: bytes) -> int:
    """The hash a router sees for the block keyed ``key``: its low 64 bits, unsigned (as vLLM
    turns its SHA-256 hashes into ints)."""
    return int.from_bytes(key, "big") & ((1 << HASH_BITS) - 1)


def tenant_tag(namespace_digest: bytes) -> str:
    """The opaque per-tenant id of a namespace: keyed BLAKE2b of a fixed string under the
    namespace digest. The same on every replica of a deployment (they share the digest), and
    it tells nothing of the digest, which keys every block key."""
    return hashlib.blake2b(TAG_DOMAIN, key=namespace_digest, digest_size=TAG_BYTES).hexdigest()


def is_root(meta: BlockMeta) -> bool:
    """Whether ``meta`` is a prompt's first block (its parent key is all zeros)."""
    return not any(meta.parent_key)


def block_stored(meta: BlockMeta, medium: str, tag: str | None) -> BlockStored:
    """The event saying ``medium`` holds the block ``meta`` names.

    Args:
        meta: the block (key, parent key, token bytes).
        medium: "GPU" or "CPU".
        tag: the tenant's id (``tenant_tag``), or None for the shared scope.
    """
    token_ids = tokens_from_bytes(meta.tokens).tolist()
    root = is_root(meta)
    return BlockStored(
        block_hashes=[block_hash(meta.key)],
        parent_block_hash=None if root else block_hash(meta.parent_key),
        token_ids=token_ids,
        block_size=len(token_ids),
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[(tag,) if root and tag is not None else None],
        group_idx=GROUP_IDX,
        kv_cache_spec_kind=SPEC_KIND,
    )


def block_removed(keys: list[BlockKey], medium: str) -> BlockRemoved:
    """The event saying ``medium`` no longer holds the blocks ``keys``."""
    return BlockRemoved(block_hashes=[block_hash(k) for k in keys], medium=medium,
                        group_idx=GROUP_IDX)
