"""The Redis tier: blocks shared by every replica, one authenticated key per block
(``tiers.redis_store``), and the stream replicas tell each other their evictions on."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from gateway.core.quantization import EXACT, QUANTIZATIONS
from tiers.kinds.base import TierContext, flag_problems, is_seconds

if TYPE_CHECKING:
    from tiers.base import BlockStore
    from tiers.redis_events import RedisEventLog


@dataclass(frozen=True, slots=True, kw_only=True)
class RedisTierConfig:
    """``[[cache.tier]] kind = "redis"``: the Redis shared by replicas.

    Attributes:
        url: ``redis://`` or ``rediss://`` (``KVGATE_REDIS_URL`` or its ``_FILE`` wins, so that
            a password need not sit in the file).
        cluster: ``url`` names a node of a Redis Cluster.
        ttl_s: the longest a block lives in Redis without a hit (a block's own shorter TTL
            wins; a pinned block never expires).
        timeout_s: bound on each Redis operation: the most a stalled Redis adds.
        key_prefix: first part of every Redis key.
        retry_after_s: after Redis failed, how long the circuit breaker waits before probing it
            again (meanwhile every request skips Redis at once).
        write: write every new chain through to Redis.
        write_bytes_per_s: bytes per second each tenant may write to Redis (bursts of one
            second's worth); past it the rest of a chain stays local. None: no limit. Blocks of
            the shared scope (published by admins) are not counted.
        quantize: "none" (exact, the default) or the lossy format it stores ("int8", "fp8").
    """

    kind: ClassVar[str] = "redis"
    size_keys: ClassVar[tuple[str, ...]] = ("write_bytes_per_s",)
    path_keys: ClassVar[tuple[str, ...]] = ()

    url: str | None = field(default=None, repr=False)
    cluster: bool = False
    ttl_s: float = 3600.0
    timeout_s: float = 0.25
    key_prefix: str = "kvgate"
    retry_after_s: float = 5.0
    write: bool = True
    write_bytes_per_s: int | None = None
    quantize: str = EXACT

    @property
    def budget_bytes(self) -> None:
        return None

    @property
    def lossy_format(self) -> str | None:
        return None if self.quantize == EXACT else self.quantize

    @property
    def write_through(self) -> bool:
        return self.write

    def problems(self) -> list[str]:
        errors = []
        if not isinstance(self.url, str) or not self.url:
            errors.append("url is needed (redis:// or rediss://; or KVGATE_REDIS_URL)")
        for name in ("ttl_s", "timeout_s", "retry_after_s"):
            if not is_seconds(getattr(self, name)):
                errors.append(f"{name} must be a positive number of seconds, got "
                              f"{getattr(self, name)!r}")
        errors += flag_problems(self, ("cluster", "write"))
        if not isinstance(self.key_prefix, str) or not self.key_prefix:
            errors.append(f"key_prefix must be a non-empty string, got {self.key_prefix!r}")
        if self.write_bytes_per_s is not None and (
                isinstance(self.write_bytes_per_s, bool) or self.write_bytes_per_s < 1):
            errors.append("write_bytes_per_s must be >= 1 (or unset for no limit)")
        if self.quantize != EXACT and self.quantize not in QUANTIZATIONS:
            errors.append(f"quantize must be {EXACT!r} or one of "
                          f"{', '.join(map(repr, QUANTIZATIONS))}, got {self.quantize!r}")
        return errors


class RedisTier:
    """The Redis tier's kind (``tiers.redis_store.RedisStore`` behind a circuit breaker)."""

    kind = RedisTierConfig.kind
    tier_name = RedisTierConfig.kind
    config_type = RedisTierConfig
    is_remote = True
    may_be_lossy = True
    queues_writes = True
    is_measured = True
    parallel_reads = 1

    def open(self, config: RedisTierConfig, context: TierContext) -> BlockStore:
        # NOTE: imported here, so that reading a configuration imports neither a store nor
        # the Redis client.
        from tiers.breaker import CircuitBreaker
        from tiers.redis_store import RedisStore

        return RedisStore(context.codec_for(config.lossy_format), url=config.url,
                          cluster=config.cluster, key_prefix=config.key_prefix,
                          ttl_s=config.ttl_s, socket_timeout_s=config.timeout_s,
                          connect_timeout_s=config.timeout_s,
                          breaker=CircuitBreaker(reset_after_s=config.retry_after_s))

    def open_events(self, config: RedisTierConfig) -> RedisEventLog:
        """The eviction stream beside the blocks (``{key_prefix}:events``)."""
        from tiers.redis_events import RedisEventLog

        assert config.url is not None
        return RedisEventLog(config.url, name=f"{config.key_prefix}:events",
                             cluster=config.cluster, timeout_s=config.timeout_s)
