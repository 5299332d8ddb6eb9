"""Building the cache layer: stores, tier hierarchy, policies and prefix cache from one config.

``open_cache`` is the one function that the composition root (``gateway.service.assembly``)
calls for the cache: every store, policy and the prefix cache get what they need through their
constructors here, from one validated, frozen ``CacheConfig`` (``gateway.cache.config``);
nothing reaches for globals. It is a loop over the config's tiers: each tier's kind
(``tiers.kinds.registry.TIER_KINDS``) opens its store, so a new tier is a new kind, not a new
branch here. It also starts what has threads (disk writer, remote writer) and re-indexes what a
persistent tier kept from the last run (``gateway.cache.operations.adoption``), pinning again what
the pin log beside it names (``gateway.cache.pins``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from gateway.cache.base import TierEvents
from gateway.cache.config import CacheConfig as CacheConfig
from gateway.cache.operations.adoption import adopt
from gateway.cache.operations.sweeper import ExpirySweeper
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.cache.sessions import SessionLimits
from gateway.core.fingerprint import Scope
from gateway.core.quantization import EXACT, parse_quantization
from gateway.core.sizes import GiB as GiB
from policies.base import BlockKey
from policies.rate import TenantRates
from policies.registry import TierPolicyConfig, build_tier_policy
from tiers.base import RemoteStore
from tiers.codec import BlockCodec, derive_mac_key
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.kinds.base import RemoteTierKind, TierConfig, TierContext
from tiers.kinds.registry import TIER_KINDS
from tiers.page_pool import PagePool
from tiers.payload import KVLayout
from tiers.pin_manifest import PinManifest
from tiers.redis_events import RedisEventLog

logger = logging.getLogger(__name__)

RUNNING_BYTES = (2 << 30) + (2 << 30) // 16 + (256 << 20)
"""The pool's room for running requests when the caller names none: the engine's defaults
(2 GiB of KV with its 1/16 margin, 256 MiB of tails)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenedCache:
    """A running cache and what it is made of; ``close`` stops it."""

    cache: PrefixCache
    hierarchy: TierHierarchy
    codec: BlockCodec
    num_recovered_blocks: int
    sweeper: ExpirySweeper | None = None
    events: RedisEventLog | None = None
    """The stream replicas tell each other their evictions on (with Redis only)."""
    pool: PagePool | None = None
    """The device tier's pages, for the engine's requests too (``Engine(pool=...)``)."""

    def close(self) -> None:
        """Stop the sweeper, then flush and close the stores (stop the engine first)."""
        if self.sweeper is not None:
            self.sweeper.stop()
        self.hierarchy.flush(timeout_s=30.0)
        self.hierarchy.close()


def has_tier_to_measure(config: CacheConfig) -> bool:
    """Whether start-up measures load and recompute speeds (``measure_at_start``): only a tier
    whose kind may load slower than recomputing (disk, Redis) is measured, and only where the
    cache skips slow tiers does the figure decide anything."""
    lower = any(TIER_KINDS[tier.kind].is_measured for tier in config.tiers)
    return config.measure_at_start and config.skip_slow_tiers and lower


def queued_write_bytes(config: CacheConfig) -> int:
    """The pool's room for pages waiting in the write queues (disk, Redis): a queued write holds
    the device tier's page itself until its writer has encoded it (no copy on the request's
    thread), also after the device tier let it go, so each queue may hold up to
    ``write_queue_bytes`` of pages no budget counts. Without this room a slow disk or Redis
    leaves running requests without a page (an 8B model's 8k-token chains on an H100,
    2026-11-27: RESOURCE_EXHAUSTED, every page held, once the device tier had let go of
    pages its writes still held)."""
    queues = sum(TIER_KINDS[tier.kind].queues_writes for tier in config.tiers)
    return queues * config.write_queue_bytes


def open_cache(
    config: CacheConfig,
    *,
    layout: KVLayout,
    deployment_secret: bytes,
    clock: Callable[[], float] = time.monotonic,
    device: torch.device | str = "cpu",
    running_bytes: int = RUNNING_BYTES,
    tier_events: TierEvents | None = None,
) -> OpenedCache:
    """Open every tier of ``config``, in its order, for a model with ``layout`` on ``device``,
    and the prefix cache over them; start what has threads.

    The device tier's blocks are pages of one pool (``tiers.page_pool``) that also holds the
    running requests' own pages: its budget plus ``running_bytes`` (the engine's KV budget
    and tails, with its margin: ``gateway.engine.kv.sequence.pool_bytes_for``) plus the pages
    the write queues may hold (``queued_write_bytes``). A persistent tier's blocks from an
    earlier run are re-indexed (headers only) and served again. ``tier_events`` (the KV-events
    publisher, started and closed by the caller) hears of every copy a tier gains or loses.
    """
    device = torch.device(device)
    pool = PagePool.for_budget(layout, page_tokens=config.block_tokens, device=device,
                               budget_bytes=(config.device_bytes + running_bytes
                                             + queued_write_bytes(config)))
    context = TierContext(layout=layout, block_tokens=config.block_tokens, device=device,
                          pool=pool, codec_for=_codecs(config, layout, deployment_secret, device),
                          write_queue_bytes=config.write_queue_bytes, clock=clock)
    levels, slots, remote, remote_config = _open_tiers(config, context)
    pin_log = _pin_log(config, deployment_secret)
    pinned = frozenset() if pin_log is None else pin_log.load()
    rate = None if remote_config is None else remote_config.write_bytes_per_s
    budget = None if rate is None else TenantRates(rate, rate, clock=clock)
    hierarchy = TierHierarchy(levels, remote=remote, remote_budget=budget,
                              remote_max_pending_bytes=config.write_queue_bytes,
                              remote_exempt_owners=frozenset({Scope.shared().owner}),
                              reprobe_interval_s=config.reprobe_interval_s,
                              skip_slow_tiers=config.skip_slow_tiers)
    cache = PrefixCache(
        tiers=slots, block_tokens=config.block_tokens, hierarchy=hierarchy, clock=clock,
        remote_write=remote_config is None or remote_config.write_through,
        remote_quantization=parse_quantization(getattr(remote_config, "lossy_format", None)
                                               or EXACT),
        events=tier_events, sessions=SessionLimits(ttl_s=config.session_ttl_s,
                                                   max_per_tenant=config.max_sessions_per_tenant),
        pin_log=pin_log)
    num_recovered = sum(_start(level.name, level.store, cache, pinned) for level in levels)
    if remote is not None:
        _start(remote.name, remote, cache, frozenset())
    hierarchy.start()
    sweeper = ExpirySweeper(cache, interval_s=config.sweep_interval_s)
    sweeper.start()
    events = (None if remote_config is None
              else _remote_kind(remote_config).open_events(remote_config))
    return OpenedCache(cache=cache, hierarchy=hierarchy, codec=context.codec_for(None),
                       num_recovered_blocks=num_recovered, sweeper=sweeper, events=events,
                       pool=pool)


def _open_tiers(config: CacheConfig, context: TierContext) -> tuple[
        list[TierLevel], list[TierSlot], RemoteStore | None, Any]:
    """Each tier's store, opened by its kind, in the config's order: the local ones as levels
    of the hierarchy and slots of the cache; the remote one (with its record) apart."""
    levels: list[TierLevel] = []
    slots: list[TierSlot] = []
    remote: RemoteStore | None = None
    remote_config: Any = None
    for tier in config.tiers:
        kind = TIER_KINDS[tier.kind]
        store = kind.open(tier, context)
        if kind.is_remote:
            remote, remote_config = cast(RemoteStore, store), tier
            continue
        levels.append(TierLevel(name=kind.tier_name, store=store,
                                parallel_reads=kind.parallel_reads))
        slots.append(_slot(config, kind.tier_name, tier, context.clock,
                           keeps_pins=hasattr(store, "take_recovered")))
    return levels, slots, remote, remote_config


def _remote_kind(config: Any) -> RemoteTierKind:
    return cast(RemoteTierKind, TIER_KINDS[config.kind])


def _codecs(config: CacheConfig, layout: KVLayout, deployment_secret: bytes,
            device: torch.device) -> Callable[[str | None], BlockCodec]:
    """One codec per format (None: exact), built when a tier first asks for it."""
    codecs: dict[str | None, BlockCodec] = {}

    def codec_for(quantize: str | None) -> BlockCodec:
        if quantize not in codecs:
            codecs[quantize] = BlockCodec(
                mac_key=derive_mac_key(deployment_secret), layout=layout,
                block_tokens=config.block_tokens, compression=config.compression,
                quantize=parse_quantization(quantize or EXACT), device_type=device.type)
        return codecs[quantize]

    return codec_for


def _slot(config: CacheConfig, name: str, tier: TierConfig,
          clock: Callable[[], float], *, keeps_pins: bool) -> TierSlot:
    """A local tier as the cache sees it: its policy, write-through, format, and whether a
    restart finds its blocks again (``keeps_pins``)."""
    assert tier.budget_bytes is not None, f"the local {name} tier has no budget"
    policy = TierPolicyConfig(order=config.order, budget_bytes=tier.budget_bytes,
                              quotas=config.quotas,
                              default_quota_bytes=config.tenant_quota.get(name))
    return TierSlot(name=name, write_through=tier.write_through, keeps_pins=keeps_pins,
                    quantization=parse_quantization(tier.lossy_format or EXACT),
                    policy=build_tier_policy(policy, clock=clock))


def _start(name: str, store: object, cache: PrefixCache, pinned: frozenset[BlockKey]) -> int:
    """Start ``store`` where it has threads or connections; adopt what a persistent store
    recovered from an earlier run (``gateway.cache.operations.adoption``), pinning those of
    ``pinned``. How many blocks it adopted."""
    start = getattr(store, "start", None)
    if start is not None:
        start()
    take_recovered = getattr(store, "take_recovered", None)
    if take_recovered is None:
        return 0
    found = [(header.meta, header.raw_len) for header in take_recovered()]
    num_adopted = adopt(cache, name, found, pinned=pinned)
    if found:
        logger.info("%s tier: %d of %d blocks from the last run are served again (the others "
                    "had expired or lost a parent)", name, num_adopted, len(found))
    return num_adopted


def pin_log_path(config: CacheConfig) -> Path | None:
    """Where a replica keeps the keys of its pinned blocks (``tiers.pin_manifest``): beside the
    persistent tier, whose blocks are what a pin can outlive a restart in (None without one)."""
    path = config.persistent_path
    return None if path is None else path / "pins"


def _pin_log(config: CacheConfig, deployment_secret: bytes) -> PinManifest | None:
    path = pin_log_path(config)
    if path is None:
        return None
    fsync = all(getattr(tier, "fsync", True) for tier in config.tiers)
    return PinManifest(path, derive_mac_key(deployment_secret), fsync=fsync)


def eviction_cursor_path(config: CacheConfig) -> Path | None:
    """Where a replica keeps the id of the last eviction it applied: beside the persistent
    tier, whose blocks are what outlives a restart (None without one: nothing to catch up on)."""
    path = config.persistent_path
    return None if path is None else path / "eviction-cursor"
