"""Where the lossy copies of exact blocks are filed, so that whatever drops a block (a session
reset, an eviction by tag, prefix or tenant) drops its copies too (docs/design.md, "Lossy
tiers"). A copy's key is the block's chain hashed under the lossy namespace: it is found from
the chain's tokens, which the index keeps, not from the exact key."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.cache.prefix_cache import PrefixCache
from gateway.cache.radix_index import BlockRecord
from gateway.core.fingerprint import Namespace
from gateway.core.tokens import tokens_from_bytes
from policies.base import BlockKey


def lossy_copies(cache: PrefixCache,
                 records: Iterable[BlockRecord]) -> list[tuple[Namespace, BlockKey]]:
    """The lossy namespace and key of each exact record's copy, whether or not a tier holds it;
    [] when no tier keeps lossy copies. Hold ``cache.placement.locked()`` (it walks each
    record's ancestors)."""
    copies: list[tuple[Namespace, BlockKey]] = []
    for record in records:
        lossy = cache.lossy_namespace(record.namespace)
        if lossy is None:
            continue
        path: list[bytes] = []
        node: BlockRecord | None = record
        while node is not None:
            path.append(node.tokens)
            node = node.parent
        tokens = tokens_from_bytes(b"".join(reversed(path)))
        copies.append((lossy, cache.fingerprinter(lossy).block_keys(tokens)[-1]))
    return copies
