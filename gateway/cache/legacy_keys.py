"""The ``[cache]`` keys that named the tiers before ``[[cache.tier]]``, read as a tier list.

``host_bytes = "4GiB"``, ``disk_bytes``/``disk_path``, ``redis_url`` and their neighbours still
work, in a file (``gateway.config.cache_section`` logs one deprecation line naming the keys) and
as ``CacheConfig(...)`` keywords; ``tiers_of_keys`` turns them into the same records a
``[[cache.tier]]`` list gives. ``TierListView`` answers the old names from a tier list, for the
code that still reads them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gateway.cache.lossy_tiers import lossy_tiers, quantize_problems
from gateway.core.quantization import EXACT, QUANTIZATIONS
from tiers.kinds.base import TierConfig
from tiers.kinds.device import DeviceTierConfig
from tiers.kinds.disk import DiskTierConfig
from tiers.kinds.host import HOST, HostTierConfig
from tiers.kinds.quantized_host import QuantizedHostTierConfig
from tiers.kinds.registry import TIER_KINDS
from tiers.kinds.remote import RedisTierConfig

KEY_TO_FIELD: Mapping[str, tuple[str, str]] = MappingProxyType({
    "device_bytes": ("device", "bytes"),
    "host_bytes": (HOST, "bytes"),
    "layered_host_loads": (HOST, "layered_loads"),
    "disk_bytes": ("disk", "bytes"),
    "disk_path": ("disk", "path"),
    "disk_fsync": ("disk", "fsync"),
    "disk_write_through": ("disk", "write_through"),
    "redis_url": ("redis", "url"),
    "redis_cluster": ("redis", "cluster"),
    "redis_ttl_s": ("redis", "ttl_s"),
    "redis_timeout_s": ("redis", "timeout_s"),
    "redis_key_prefix": ("redis", "key_prefix"),
    "redis_retry_after_s": ("redis", "retry_after_s"),
    "remote_write": ("redis", "write"),
    "redis_write_bytes_per_s": ("redis", "write_bytes_per_s"),
})
"""Each old key: (the tier it sets, that tier's field)."""
LEGACY_KEYS = frozenset({*KEY_TO_FIELD, "quantize"})
"""The old keys, ``quantize = { host = "int8" }`` among them."""
QUANTIZE_NOT_A_TABLE = 'quantize must be a table of tier = format, e.g. { redis = "int8" }'
LEGACY_SIZE_KEYS = frozenset({"device_bytes", "host_bytes", "disk_bytes",
                              "redis_write_bytes_per_s"})


def tiers_of_keys(values: Mapping[str, Any]) -> tuple[tuple[TierConfig, ...], list[str]]:
    """The tier list the old keys describe, and what is wrong with them.

    As before ``[[cache.tier]]``: the device tier always; the host tier unless ``host_bytes``
    is 0 (4 GiB by default; quantized where ``quantize`` names it); the disk tier where
    ``disk_bytes`` is set (above 0); Redis where ``redis_url`` is."""
    quantize = values.get("quantize", {})
    errors = []
    if not isinstance(quantize, Mapping):
        errors.append(QUANTIZE_NOT_A_TABLE)
        quantize = {}
    errors += quantize_problems(quantize)
    formats = {tier: value for tier, value in lossy_tiers(quantize).items()
               if value in QUANTIZATIONS}
    by_tier: dict[str, dict[str, Any]] = {}
    for key, (tier, name) in KEY_TO_FIELD.items():
        if values.get(key) is not None:
            by_tier.setdefault(tier, {})[name] = values[key]
    tiers: list[TierConfig] = [DeviceTierConfig(**by_tier.get("device", {}))]
    host = by_tier.get(HOST, {})
    if host.get("bytes", 1):
        if formats.get(HOST):
            tiers.append(QuantizedHostTierConfig(bytes=host.get("bytes", 4 << 30),
                                                 quantize=formats[HOST]))
        else:
            tiers.append(HostTierConfig(**host))
    disk = by_tier.get("disk", {})
    if disk.get("bytes", 0):
        tiers.append(DiskTierConfig(**disk, quantize=formats.get("disk", EXACT)))
    redis = by_tier.get("redis", {})
    if redis.get("url"):
        tiers.append(RedisTierConfig(**redis, quantize=formats.get("redis", EXACT)))
    return tuple(tiers), errors


_TIER_PROBLEM = re.compile(r"^(\w+) tier: (\w+)(.*)$", re.DOTALL)


def spelled_as_keys(problem: str) -> str:
    """A tier's problem in the old key's words (``host tier: bytes must ...`` ->
    ``host_bytes must ...``), for a list the old keys described."""
    match = _TIER_PROBLEM.match(problem)
    if match is None:
        return problem
    for key, field in KEY_TO_FIELD.items():
        if field == (match.group(1), match.group(2)):
            return key + match.group(3)
    return problem


class TierListView:
    """The old ``[cache]`` names, read from ``self.tiers`` (0, None or the default where the
    tier is absent), for the code that still reads them."""

    __slots__ = ()
    tiers: Sequence[TierConfig]

    def tier(self, name: str) -> TierConfig | None:
        """The record of the tier the cache calls ``name``, or None."""
        for config in self.tiers:
            if TIER_KINDS[config.kind].tier_name == name:
                return config
        return None

    def _field(self, key: str, absent: Any) -> Any:
        tier, name = KEY_TO_FIELD[key]
        config = self.tier(tier)
        return getattr(config, name, absent) if config is not None else absent

    @property
    def device_bytes(self) -> int:
        return int(self._field("device_bytes", 0))

    @property
    def host_bytes(self) -> int:
        return int(self._field("host_bytes", 0))

    @property
    def layered_host_loads(self) -> bool:
        return bool(self._field("layered_host_loads", False))

    @property
    def disk_bytes(self) -> int:
        return int(self._field("disk_bytes", 0))

    @property
    def disk_path(self) -> Path | None:
        return self._field("disk_path", None)  # type: ignore[no-any-return]

    @property
    def disk_fsync(self) -> bool:
        return bool(self._field("disk_fsync", True))

    @property
    def disk_write_through(self) -> bool:
        return bool(self._field("disk_write_through", True))

    @property
    def redis_url(self) -> str | None:
        return self._field("redis_url", None)  # type: ignore[no-any-return]

    @property
    def redis_cluster(self) -> bool:
        return bool(self._field("redis_cluster", False))

    @property
    def redis_ttl_s(self) -> float:
        return float(self._field("redis_ttl_s", RedisTierConfig().ttl_s))

    @property
    def redis_timeout_s(self) -> float:
        return float(self._field("redis_timeout_s", RedisTierConfig().timeout_s))

    @property
    def redis_key_prefix(self) -> str:
        return str(self._field("redis_key_prefix", RedisTierConfig().key_prefix))

    @property
    def redis_retry_after_s(self) -> float:
        return float(self._field("redis_retry_after_s", RedisTierConfig().retry_after_s))

    @property
    def remote_write(self) -> bool:
        return bool(self._field("remote_write", True))

    @property
    def redis_write_bytes_per_s(self) -> int | None:
        return self._field("redis_write_bytes_per_s", None)  # type: ignore[no-any-return]

    @property
    def quantize(self) -> Mapping[str, str]:
        """``{tier: format}`` of the lossy tiers."""
        return MappingProxyType({TIER_KINDS[c.kind].tier_name: c.lossy_format
                                 for c in self.tiers if c.lossy_format is not None})
