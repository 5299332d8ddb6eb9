"""Tags on cached blocks: marking the blocks of a prompt, and finding them again.

A tag (``gateway.core.tags``) is recorded on the ``BlockRecord`` of every cached full block of
a tagged request's prompt, after the request has stored them: the servicer calls
``CacheAdmin.tag_prompt`` once Warm (or Generate) has finished, so the engine's store path does
not change. Blocks the prompt shares with earlier prompts get the tag too: "drop everything
warmed for docs-v3" means every block docs-v3 needs, not only those it happened to compute.

NOTE: tags live in this replica's index only. The disk tier's headers and Redis' metadata do
not carry them, so a block adopted after a restart, or loaded from Redis by another replica,
is untagged there; an eviction by tag still removes the tagged blocks' Redis copies (by key),
and reaches the replicas that tagged their own copies through the eviction stream.
"""

from __future__ import annotations

from gateway.cache.prefix_cache import PrefixCache
from gateway.cache.radix_index import BlockRecord, RadixIndex
from gateway.core.fingerprint import Namespace
from gateway.core.tokens import TokenIds


def tag_prompt(cache: PrefixCache, namespace: Namespace, tokens: TokenIds, tag: str) -> int:
    """Record ``tag`` on the cached full blocks of ``tokens`` in ``namespace``.

    Only ``namespace`` is matched: a tenant's request tags that tenant's blocks, never the
    shared scope's blocks it may have read.

    Returns:
        How many blocks gained the tag (0 if every cached block already had it).
    """
    keys = cache.fingerprinter(namespace).block_keys(tokens)
    placement = cache.placement
    with placement.locked():
        _, records, _ = cache.match_records(namespace, tokens, keys)
        num_tagged = 0
        for record in records:
            if tag not in record.tags:
                record.tags = record.tags | {tag}
                num_tagged += 1
        return num_tagged


def tagged_blocks(index: RadixIndex, tag: str, *, owner: str | None = None
                  ) -> list[BlockRecord]:
    """Every block carrying ``tag`` (of ``owner`` only, if given) and every block after one.

    The blocks after a tagged block go with it: a block is only useful with all its ancestors.
    Hold ``placement.locked()``.
    """
    selected: dict[int, BlockRecord] = {}
    for record in index.records():
        if tag not in record.tags or id(record) in selected:
            continue
        if owner is not None and record.namespace.scope.owner != owner:
            continue
        for block in index.subtree(record.namespace, record):
            selected.setdefault(id(block), block)
    return list(selected.values())


def tags_of(path: list[BlockRecord]) -> tuple[str, ...]:
    """The tags of a prompt's blocks, sorted (a listing shows a prompt by its path)."""
    tags: set[str] = set()
    for record in path:
        tags |= record.tags
    return tuple(sorted(tags))
