"""kvgate's cache inside vLLM's worker process: the scheduler's orders carried out on vLLM's
pages.

Why the worker owns the cache: the bytes are in its process (vLLM's KV tensors), and every
tier -- host memory, disk, Redis -- is reached from there with the block codec, the MAC and the
quotas kvgate uses everywhere (docs/vllm-worker.md, "How it works"). A load is
``PrefixCache.acquire`` and ``load``: a block that is missing or fails verification cuts the
chain there, and vLLM's blocks from there on are reported for vLLM to recompute. A save copies
each vLLM page into a page of kvgate's own pool before ``insert``: the disk and Redis writers
keep what they are handed until their threads encode it, and vLLM reuses its blocks at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from gateway.cache.operations.factory import OpenedCache
from gateway.core.fingerprint import Namespace, Scope
from gateway.core.tokens import as_token_ids
from gateway.vllm_connector.key_changes import KeyChanges
from gateway.vllm_connector.orders import LoadOrder, LoadOutcome, SaveOrder, WorkerReport
from gateway.vllm_connector.pages import load_page, save_page
from gateway.vllm_connector.scope_tag import parse_scope
from tiers.page_pool import PagedBlock, PoolExhausted, await_arrival

logger = logging.getLogger(__name__)


class WorkerCache:
    """An opened kvgate cache serving one vLLM worker's KV tensors.

    Args:
        opened: the cache (``open_cache`` with the page layout's ``kv_layout``, a pool).
        layers: vLLM's KV tensor of every layer, in layer order (``pages.layer_problems``
            found nothing wrong with them).
        namespace_of: a scope's namespace (``VllmPageLayout.namespace``).
        changes: the cache's tier events (``open_cache(tier_events=...)``), where blocks
            arrive and leave without an order (evictions, expiry, the recovered disk).
    """

    def __init__(self, opened: OpenedCache, *, layers: Sequence[torch.Tensor],
                 namespace_of: Callable[[Scope], Namespace],
                 changes: KeyChanges | None = None) -> None:
        if opened.pool is None:
            raise ValueError("the worker's cache needs its page pool (open_cache gives one)")
        self._opened = opened
        self._cache = opened.cache
        self._pool = opened.pool
        self._layers = tuple(layers)
        self._namespace_of = namespace_of
        self._tier = opened.cache.tier_names[0]
        self._changes = changes

    def report_changes(self, report: WorkerReport) -> None:
        """Add what the tiers gained and lost since the last report to ``report``."""
        if self._changes is None:
            return
        stored, gone = self._changes.drain(self._cache.tiers_of)
        report.stored.update(stored)
        report.stored.difference_update(gone)
        report.lost.update(gone)

    def load(self, order: LoadOrder, report: WorkerReport) -> LoadOutcome:
        """Fill the order's vLLM blocks from the cache, as far as it verifies; say how far in
        ``report`` (and which key fell short)."""
        namespace = self._namespace_of(parse_scope(order.scope))
        end = order.first_block + len(order.block_ids)
        with self._cache.acquire(namespace, as_token_ids(order.tokens)) as lease:
            blocks = self._cache.load(lease, max_blocks=end)
            for block, block_id in zip(blocks[order.first_block:end], order.block_ids,
                                       strict=False):
                await_arrival(block)
                load_page(block, self._layers, block_id)
            num_served = min(len(blocks), end)
            if num_served < end:
                report.lost.add(lease.keys[num_served])
        num_loaded = max(0, num_served - order.first_block)
        outcome = LoadOutcome(num_loaded=num_loaded,
                              failed_block_ids=tuple(order.block_ids[num_loaded:]))
        report.loads[order.request_id] = outcome
        return outcome

    def save(self, order: SaveOrder, report: WorkerReport) -> int:
        """Store the order's blocks the cache does not hold yet; the keys it holds afterwards
        go into ``report``. Returns how many blocks were stored anew."""
        namespace = self._namespace_of(parse_scope(order.scope))
        with self._cache.acquire(namespace, as_token_ids(order.tokens),
                                 to_load=False) as lease:
            start = lease.match.num_blocks
            pages: list[PagedBlock] = []
            try:
                for block_id in order.block_ids[start:]:
                    pages.append(save_page(self._layers, block_id, self._pool))
            except PoolExhausted:
                logger.warning("kvgate: the page pool is full; %d of request %s's blocks are "
                               "not stored", len(order.block_ids) - start - len(pages),
                               order.request_id)
            result = self._cache.insert(lease, tier=self._tier, blocks=pages)
            num_kept = start + result.num_new_blocks + result.num_existing_blocks
            report.stored.update(lease.keys[:num_kept])
        return result.num_new_blocks

    def close(self) -> None:
        """Flush the writers (disk, Redis) and close the tiers."""
        self._opened.close()
