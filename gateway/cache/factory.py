"""Building the cache layer: stores, tier hierarchy, policies and prefix cache from one config.

``open_cache`` is the one function that the composition root (``gateway.service.assembly``)
calls for the cache: every store, policy and the prefix cache get what they need through their
constructors here, from one validated, frozen ``CacheConfig``; nothing reaches for globals. It
also starts what has threads (disk writer, remote writer) and re-indexes what the disk tier
kept from the last run (``gateway.cache.adoption``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import torch

from gateway.cache.adoption import adopt
from gateway.cache.base import TierEvents
from gateway.cache.lossy_tiers import lossy_tiers, quantize_problems
from gateway.cache.prefix_cache import PrefixCache, TierSlot
from gateway.cache.sessions import (
    DEFAULT_MAX_SESSIONS_PER_TENANT,
    DEFAULT_SESSION_TTL_S,
    SessionLimits,
)
from gateway.cache.sweeper import ExpirySweeper
from gateway.core.fingerprint import Scope
from gateway.core.quantization import parse_quantization
from policies.rate import TenantRates
from policies.registry import ORDER_POLICIES, TierPolicyConfig, build_tier_policy
from tiers.breaker import CircuitBreaker
from tiers.codec import BlockCodec, derive_mac_key
from tiers.disk import DiskStore
from tiers.hierarchy import TierHierarchy, TierLevel
from tiers.layer_arrivals import LayerArrivals, LayeredLoadsUnavailable
from tiers.memory import DeviceStore, HostStore
from tiers.page_pool import PagePool
from tiers.payload import KVLayout
from tiers.quantized_host import QuantizedHostStore
from tiers.redis_events import RedisEventLog
from tiers.redis_store import RedisStore

DISK_PARALLEL_READS = 2
"""Blocks of one load read from the disk tier at once: the file reads and the MAC checks of a
chain's blocks overlap (the reads release the GIL), instead of waiting block after block."""

logger = logging.getLogger(__name__)

GiB = 1 << 30
LOCAL_TIERS = ("device", "host", "disk")

RUNNING_BYTES = (2 << 30) + (2 << 30) // 16 + (256 << 20)
"""The pool's room for running requests when the caller names none: the engine's defaults
(2 GiB of KV with its 1/16 margin, 256 MiB of tails)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """What the cache is made of. Budgets are bytes; a budget of 0 turns a tier off.

    Attributes:
        block_tokens: tokens per block (the unit of storage and sharing).
        order: eviction order of every tier ("lru" or "clock").
        device_bytes: the device tier's budget (GPU memory, or CPU memory without a GPU).
        host_bytes: the host tier's budget (CPU memory, pinned with CUDA).
        disk_bytes: the disk tier's budget; needs ``disk_path``.
        disk_path: where the disk tier keeps its files (meant for a local NVMe).
        disk_fsync: fsync every block file and its directory before it counts as durable.
        disk_write_through: write every new block to disk at once (queued, off the request
            path), so that a restart finds everything, not only what had been demoted.
        redis_url: the Redis shared by replicas (``redis://`` / ``rediss://``), or None.
        redis_cluster: ``redis_url`` names a node of a Redis Cluster.
        redis_ttl_s: the longest a block lives in Redis without a hit (a block's own shorter
            TTL wins; a pinned block never expires).
        redis_timeout_s: bound on each Redis operation: the most a stalled Redis adds.
        redis_key_prefix: first part of every Redis key.
        redis_retry_after_s: after Redis failed, how long the circuit breaker waits before
            probing it again (meanwhile every request skips Redis at once).
        remote_write: write every new chain through to Redis.
        quotas: bytes per tenant (applied in every tier), e.g. {"tenant-a": 2 * GiB}.
        tenant_quota: the quota of every tenant without one in ``quotas``, per tier name, e.g.
            {"device": GiB, "host": 2 * GiB}; a tier left out has none. Over its quota a tenant
            evicts only its own blocks, so one tenant's flood cannot push the others out.
        redis_write_bytes_per_s: bytes per second each tenant may write to Redis (bursts of one
            second's worth); past it the rest of a chain stays local. None: no limit. Blocks of
            the shared scope (published by admins) are not counted.
        write_queue_bytes: block bytes queued for writing to disk, and to Redis, at most (each
            its own queue): past it new blocks are dropped (counted), never waited for; of a
            chain too big for the room left, its head is written. Size it to hold a few of the
            longest prompts' K/V (an 8k-token prompt of an 8B model is 1 GiB).
        compression: "raw" (default; lz4 saves ~1% on real KV) or "lz4" or "auto".
        reprobe_interval_s: a tier judged slower than recomputing is skipped, except for one
            probing load per this many seconds, so that it is used again once it is fast.
        skip_slow_tiers: a tier whose loads are measured slower than recomputing is skipped
            (the blocks are recomputed); False always loads (for a busy GPU, where
            recomputing takes compute from every other request).
        measure_at_start: ``kvgate serve`` measures the disk tier's and Redis's load bandwidth,
            and the engine's recompute speed, before it serves (``gateway.cache.load_bandwidth``,
            ``gateway.engine.parity.recompute_speed``), so that the first hit on either tier is
            judged by ``skip_slow_tiers`` like every later one. Nothing to measure without either
            tier, or with ``skip_slow_tiers`` off.
        layered_host_loads: on a GPU, a host-tier hit is copied into its pages layer by layer
            on a stream of its own, and a step waits for each layer only before it reads it
            (``tiers.layer_arrivals``): the copy runs beside the step instead of before it.
            Off by default until timed on a GPU; an exact host tier only; on a CPU it copies
            the same bytes at once (no gain there).
        sweep_interval_s: how often expired blocks are removed from every tier.
        session_ttl_s: a session (``CacheOptions.session_id``) ends this long after its last
            request: its own blocks and conversation tail leave every tier, Redis included.
        max_sessions_per_tenant: sessions one tenant may have on a replica at once; one more
            ends the tenant's least recently used session at the next sweep.
        quantize: the lossy format each lower tier stores, per tier name ("host", "disk",
            "redis"), e.g. {"redis": "int8"}; "none" or left out: exact (the default).
            ``gateway.cache.lossy_tiers`` (one format for every lossy tier).
    """

    block_tokens: int = 64
    order: str = "lru"
    device_bytes: int = 2 * GiB
    host_bytes: int = 4 * GiB
    disk_bytes: int = 0
    disk_path: Path | None = None
    disk_fsync: bool = True
    disk_write_through: bool = True
    redis_url: str | None = field(default=None, repr=False)
    redis_cluster: bool = False
    redis_ttl_s: float = 3600.0
    redis_timeout_s: float = 0.25
    redis_key_prefix: str = "kvgate"
    redis_retry_after_s: float = 5.0
    remote_write: bool = True
    quotas: Mapping[str, int] = field(default_factory=dict)
    tenant_quota: Mapping[str, int] = field(default_factory=dict)
    redis_write_bytes_per_s: int | None = None
    write_queue_bytes: int = GiB
    compression: Literal["raw", "lz4", "auto"] = "raw"
    # -- lifecycle (issue 11) --
    reprobe_interval_s: float = 10.0
    skip_slow_tiers: bool = True
    measure_at_start: bool = True
    layered_host_loads: bool = False
    sweep_interval_s: float = 5.0
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    max_sessions_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT
    # -- lossy lower tiers (issue 28) --
    quantize: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        errors = self.problems()
        if errors:
            raise ValueError("invalid cache configuration: " + "; ".join(errors))
        object.__setattr__(self, "quotas", MappingProxyType(dict(self.quotas)))
        object.__setattr__(self, "tenant_quota", MappingProxyType(dict(self.tenant_quota)))
        object.__setattr__(self, "quantize", MappingProxyType(dict(self.quantize)))

    def problems(self) -> list[str]:
        """Every problem with this configuration, for one message listing them all."""
        errors = []
        if self.block_tokens < 1:
            errors.append(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.order not in ORDER_POLICIES:
            errors.append(f"order must be one of {sorted(ORDER_POLICIES)}, got {self.order!r}")
        for name in ("device_bytes", "host_bytes", "disk_bytes"):
            if getattr(self, name) < 0:
                errors.append(f"{name} must be >= 0")
        if self.device_bytes == 0:
            errors.append("device_bytes must be > 0: the device tier is where requests read KV")
        if self.disk_bytes and self.disk_path is None:
            errors.append("disk_bytes > 0 needs disk_path")
        if not (self.redis_timeout_s > 0 and math.isfinite(self.redis_timeout_s)):
            errors.append("redis_timeout_s must be a positive number of seconds")
        if not (self.redis_retry_after_s > 0 and math.isfinite(self.redis_retry_after_s)):
            errors.append("redis_retry_after_s must be a positive number of seconds")
        if not (self.redis_ttl_s > 0 and math.isfinite(self.redis_ttl_s)):
            errors.append("redis_ttl_s must be a positive number of seconds")
        for tenant, quota in self.quotas.items():
            if quota < 0:
                errors.append(f"quota of {tenant!r} must be >= 0")
        for name in ("reprobe_interval_s", "sweep_interval_s", "session_ttl_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value > 0):
                errors.append(f"{name} must be a positive number of seconds, got {value!r}")
        for tier, quota in self.tenant_quota.items():
            if tier not in LOCAL_TIERS:
                errors.append(f"tenant_quota names the tier {tier!r}; local tiers: "
                              f"{', '.join(LOCAL_TIERS)} (Redis is bounded by "
                              "redis_write_bytes_per_s)")
            elif quota < 0:
                errors.append(f"tenant_quota of the {tier} tier must be >= 0")
        for name in ("disk_fsync", "disk_write_through", "remote_write", "skip_slow_tiers",
                     "measure_at_start", "layered_host_loads"):
            if not isinstance(getattr(self, name), bool):
                errors.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.write_queue_bytes < 1:
            errors.append("write_queue_bytes must be >= 1")
        if self.redis_write_bytes_per_s is not None and self.redis_write_bytes_per_s < 1:
            errors.append("redis_write_bytes_per_s must be >= 1 (or unset for no limit)")
        if (not isinstance(self.max_sessions_per_tenant, int)
                or isinstance(self.max_sessions_per_tenant, bool)
                or not 1 <= self.max_sessions_per_tenant <= 10_000_000):
            errors.append(f"max_sessions_per_tenant must be an integer from 1 to 10000000, got "
                          f"{self.max_sessions_per_tenant!r}")
        if self.compression not in ("raw", "lz4", "auto"):
            errors.append(f"compression must be raw, lz4 or auto, got {self.compression!r}")
        if not isinstance(self.quantize, Mapping):
            errors.append("quantize must be a table of tier = format, e.g. "
                          '{ redis = "int8" }')
        else:
            errors.extend(quantize_problems(self.quantize))
        return errors


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
    """Whether start-up measures load and recompute speeds (``measure_at_start``): only a
    disk tier or Redis can be slower to load from than recomputing, and only where the cache
    skips slow tiers does the figure decide anything."""
    lower = bool(config.disk_bytes and config.disk_path is not None) or bool(config.redis_url)
    return config.measure_at_start and config.skip_slow_tiers and lower


def layer_arrivals_for(pool: PagePool) -> LayerArrivals | None:
    """Layered host loads into ``pool`` (``layered_host_loads``), or None, with a warning
    saying why, where this device cannot read pinned memory in place."""
    try:
        return LayerArrivals(pool)
    except LayeredLoadsUnavailable as error:
        logger.warning("layered_host_loads is on, but host-tier hits are copied whole: %s",
                       error)
        return None


def queued_write_bytes(config: CacheConfig) -> int:
    """The pool's room for pages waiting in the write queues (disk, Redis): a queued write holds
    the device tier's page itself until its writer has encoded it (no copy on the request's
    thread), also after the device tier let it go, so each queue may hold up to
    ``write_queue_bytes`` of pages no budget counts. Without this room a slow disk or Redis
    leaves running requests without a page (an 8B model's 8k-token chains on an H100,
    2026-11-27: RESOURCE_EXHAUSTED, every page held, once the device tier had let go of
    pages its writes still held)."""
    queues = int(bool(config.disk_bytes and config.disk_path is not None))
    queues += int(bool(config.redis_url))
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
    """Build and start every tier of ``config`` for a model with ``layout`` running on
    ``device``: the device tier lives there, and the host tier is pinned (and serves there)
    exactly when it is a GPU.

    The device tier's blocks are pages of one pool (``tiers.page_pool``) that also holds the
    running requests' own pages: ``device_bytes`` plus ``running_bytes`` (the engine's KV
    budget and tails, with its margin: ``gateway.engine.kv.sequence.pool_bytes_for``) plus
    the pages the write queues may hold (``queued_write_bytes``).

    The disk tier's files from an earlier run are re-indexed (headers only) and served again.
    ``tier_events`` (the KV-events publisher, started by the caller, who also closes it after the
    cache) is told of every copy a tier gains or loses from then on.
    """
    device = torch.device(device)
    lossy = {tier: parse_quantization(value)
             for tier, value in lossy_tiers(config.quantize).items()}
    codecs = {tier: BlockCodec(
        mac_key=derive_mac_key(deployment_secret),
        layout=layout,
        block_tokens=config.block_tokens,
        compression=config.compression,
        quantize=lossy.get(tier),
        device_type=device.type,
    ) for tier in ("exact", "disk", "redis")}
    pool = PagePool.for_budget(layout, page_tokens=config.block_tokens, device=device,
                               budget_bytes=(config.device_bytes + running_bytes
                                             + queued_write_bytes(config)))
    levels = [TierLevel(name="device", store=DeviceStore(pool=pool))]
    budgets = {"device": config.device_bytes}
    if config.host_bytes:
        host_format = lossy.get("host")
        if config.layered_host_loads and host_format is None:
            pool.arrivals = layer_arrivals_for(pool)
        levels.append(TierLevel(name="host", store=HostStore(
            layout=layout, block_tokens=config.block_tokens, budget_bytes=config.host_bytes,
            pin=device.type == "cuda", serve_device=device) if host_format is None else
            QuantizedHostStore(
                layout=layout, block_tokens=config.block_tokens, budget_bytes=config.host_bytes,
                quantization=host_format, pin=device.type == "cuda", serve_device=device)))
        budgets["host"] = config.host_bytes
    disk: DiskStore | None = None
    if config.disk_bytes and config.disk_path is not None:
        disk = DiskStore(config.disk_path, codecs["disk"], fsync=config.disk_fsync,
                         max_pending_bytes=config.write_queue_bytes)
        levels.append(TierLevel(name="disk", store=disk, parallel_reads=DISK_PARALLEL_READS))
        budgets["disk"] = config.disk_bytes
    remote: RedisStore | None = None
    if config.redis_url:
        remote = RedisStore(
            codecs["redis"],
            url=config.redis_url,
            cluster=config.redis_cluster,
            key_prefix=config.redis_key_prefix,
            ttl_s=config.redis_ttl_s,
            socket_timeout_s=config.redis_timeout_s,
            connect_timeout_s=config.redis_timeout_s,
            breaker=CircuitBreaker(reset_after_s=config.redis_retry_after_s),
        )
    budget = (None if config.redis_write_bytes_per_s is None else
              TenantRates(config.redis_write_bytes_per_s, config.redis_write_bytes_per_s,
                          clock=clock))
    hierarchy = TierHierarchy(levels, remote=remote, remote_budget=budget,
                              remote_max_pending_bytes=config.write_queue_bytes,
                              remote_exempt_owners=frozenset({Scope.shared().owner}),
                              reprobe_interval_s=config.reprobe_interval_s,
                              skip_slow_tiers=config.skip_slow_tiers)
    slots = [
        TierSlot(
            name=level.name,
            write_through=level.name == "disk" and config.disk_write_through,
            quantization=lossy.get(level.name),
            policy=build_tier_policy(
                TierPolicyConfig(order=config.order, budget_bytes=budgets[level.name],
                                 quotas=config.quotas,
                                 default_quota_bytes=config.tenant_quota.get(level.name)),
                clock=clock,
            ),
        )
        for level in levels
    ]
    cache = PrefixCache(
        tiers=slots,
        block_tokens=config.block_tokens,
        hierarchy=hierarchy,
        remote_write=config.remote_write,
        remote_quantization=lossy.get("redis"),
        clock=clock,
        events=tier_events,
        sessions=SessionLimits(ttl_s=config.session_ttl_s,
                               max_per_tenant=config.max_sessions_per_tenant),
    )
    num_recovered = 0
    if disk is not None:
        disk.start()  # runs recovery
        found = [(h.meta, h.raw_len) for h in disk.take_recovered()]
        num_recovered = adopt(cache, "disk", found)
        if found:
            logger.info("disk tier: %d of %d blocks from the last run are served again (the "
                        "others had expired or lost a parent)", num_recovered, len(found))
    if remote is not None:
        remote.start()
    hierarchy.start()
    sweeper = ExpirySweeper(cache, interval_s=config.sweep_interval_s)
    sweeper.start()
    events = None
    if config.redis_url:
        events = RedisEventLog(config.redis_url, name=f"{config.redis_key_prefix}:events",
                               cluster=config.redis_cluster, timeout_s=config.redis_timeout_s)
    return OpenedCache(cache=cache, hierarchy=hierarchy, codec=codecs["exact"],
                       num_recovered_blocks=num_recovered, sweeper=sweeper, events=events,
                       pool=pool)


def eviction_cursor_path(config: CacheConfig) -> Path | None:
    """Where a replica keeps the id of the last eviction it applied: beside the disk tier,
    whose blocks are what outlives a restart (None without one: nothing to catch up on)."""
    if not config.disk_bytes or config.disk_path is None:
        return None
    return config.disk_path / "eviction-cursor"


