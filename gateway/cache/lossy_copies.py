"""The lossy copies of exact blocks (docs/design.md, "Lossy tiers"): writing them through when
an exact chain is stored, and finding where each is filed when its block is dropped.

A copy lives in the lossy namespace of its block's namespace, under the key of the block's
chain hashed there: it is found from the chain's tokens, which the index keeps, not from the
exact key. So whatever drops a block (a session reset, an eviction by tag, prefix or tenant)
can drop its copies too (``lossy_copies``), and storing an exact chain writes its copies under
those keys (``write_lossy_copies``) -- the only step of a store that touches another
namespace, kept here with the rule that finds the copies again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from gateway.cache.leases import InsertResult, Lease, PrefixMatch
from gateway.cache.placement import TierPlacement
from gateway.cache.radix_index import BlockRecord, BlockSpec
from gateway.cache.transfers import TierTransfers
from gateway.core.fingerprint import BlockFingerprinter, Namespace
from gateway.core.tokens import TokenIds, tokens_from_bytes
from policies.base import BlockKey
from tiers.base import BlockMeta
from tiers.payload import KVBlock


class LossyCopyHost(Protocol):
    """What the copies' rules need of the cache that holds them (``PrefixCache``): named here
    so this module reads the cache without importing it (the cache imports this one)."""

    block_tokens: int

    @property
    def placement(self) -> TierPlacement: ...

    @property
    def transfers(self) -> TierTransfers | None: ...

    def lossy_namespace(self, namespace: Namespace) -> Namespace | None: ...

    def fingerprinter(self, namespace: Namespace) -> BlockFingerprinter: ...

    def match_records(self, namespace: Namespace, tokens: TokenIds, keys: list[BlockKey]
                      ) -> tuple[PrefixMatch, list[BlockRecord], bool]: ...

    def admit_chain(self, chain: list[BlockRecord], num_wanted: int, tier: str,
                    blocks: Sequence[KVBlock] | None
                    ) -> tuple[InsertResult, list[tuple[BlockMeta, KVBlock]]]: ...


def lossy_copies(cache: LossyCopyHost,
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


def write_lossy_copies(cache: LossyCopyHost, lease: Lease, start: int, end: int,
                       blocks: Sequence[KVBlock], ttl_s: float | None) -> None:
    """Write the lossy copies of an exact chain's new blocks ``start:end`` through to the
    lossy tiers, under the lossy namespace's keys (their codecs quantize them, on their
    writer threads). A lossy tier gets no other copies: exact blocks are never demoted
    into it. A local lossy tier takes them only where its chain reaches ``start`` (a block
    is only usable with its ancestors, and the ones before ``start`` were not computed
    here); Redis takes them as they are (it answers prefix-shaped)."""
    lossy = cache.lossy_namespace(lease.namespace)
    transfers = cache.transfers
    if lossy is None or transfers is None or end <= start or (
            lease.namespace.scope.kind != "tenant"):
        return  # (the shared scope's prefixes are read exact only: no copies for them)
    placement = cache.placement
    local = placement.lossy_tiers
    to_remote = transfers.writes_remote and transfers.remote_holds(lossy)
    if not local and not to_remote:
        return
    fp = cache.fingerprinter(lossy)
    keys = fp.block_keys(lease.tokens[:end * cache.block_tokens])  # no further than written
    if local:
        with placement.locked():
            _, held, _ = cache.match_records(lossy, lease.tokens, keys)
            at = len(held)
            if start <= at < end:
                specs = [BlockSpec(key=keys[i], tokens=fp.block_token_bytes(lease.tokens, i),
                                   num_bytes=blocks[i - start].nbytes)
                         for i in range(at, end)]
                chain = placement.index.insert(lossy, held[-1] if held else None, specs,
                                               now=placement.now(), ttl_s=ttl_s)
                placement.hold(chain)
                try:
                    cache.admit_chain(chain, len(specs), local[0], blocks[at - start:])
                finally:
                    placement.unhold(chain)
            moves = placement.take_moves()
        transfers.run(moves)
    if to_remote:
        expiry = placement.new_expiry(ttl_s)
        metas = [BlockMeta(key=keys[i], parent_key=keys[i - 1] if i else fp.root_parent,
                           namespace_digest=lossy.digest, owner=lossy.scope.owner,
                           tokens=fp.block_token_bytes(lease.tokens, i), expiry=expiry)
                 for i in range(start, end)]
        transfers.write_remote(list(zip(metas, blocks[:end - start], strict=True)))
