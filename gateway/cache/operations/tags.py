"""Tags on cached blocks: finding the blocks an operator's tag names, and a prompt's tags.

A tag (``gateway.core.tags``) travels with its request to the step that stores the request's
prompt (``PrefixCache.insert(tag=...)``), which records it on the ``BlockRecord`` of every
cached full block of that prompt in the request's namespace: the prompt is neither tokenised
nor matched a second time for it. Blocks the prompt shares with earlier prompts get the tag too:
"drop everything warmed for docs-v3" means every block docs-v3 needs, not only those it
happened to compute.

NOTE: tags live in this replica's index only. The disk tier's headers and Redis' metadata do
not carry them, so a block adopted after a restart, or loaded from Redis by another replica,
is untagged there; an eviction by tag still removes the tagged blocks' Redis copies (by key),
and reaches the replicas that tagged their own copies through the eviction stream.
"""

from __future__ import annotations

from gateway.cache.radix_index import BlockRecord, RadixIndex


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
