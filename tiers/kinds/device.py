"""The device tier: blocks as pages of the device's page pool, where requests read them.

Always there and always first: the pool also holds the running requests' own pages, and a hit
lists the tier's pages in a request's block table without a copy (docs/paged-kv.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from gateway.core.sizes import GiB
from tiers.kinds.base import TierContext, bytes_problem

if TYPE_CHECKING:
    from tiers.base import BlockStore


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceTierConfig:
    """``[[cache.tier]] kind = "device"``.

    Attributes:
        bytes: the tier's budget (GPU memory, or CPU memory without a GPU), beside the running
            requests' pages in the same pool.
    """

    kind: ClassVar[str] = "device"
    size_keys: ClassVar[tuple[str, ...]] = ("bytes",)
    path_keys: ClassVar[tuple[str, ...]] = ()

    bytes: int = 2 * GiB

    @property
    def budget_bytes(self) -> int:
        return self.bytes

    @property
    def lossy_format(self) -> None:
        return None

    @property
    def write_through(self) -> bool:
        return False

    def problems(self) -> list[str]:
        problem = bytes_problem(self.bytes)
        return [] if problem is None else [problem + ": the device tier is where requests "
                                                     "read KV"]


class DeviceTier:
    """The device tier's kind (``tiers.memory.DeviceStore`` over the context's pool)."""

    kind = DeviceTierConfig.kind
    tier_name = DeviceTierConfig.kind
    config_type = DeviceTierConfig
    is_remote = False
    may_be_lossy = False
    queues_writes = False
    is_measured = False
    parallel_reads = 1

    def open(self, config: DeviceTierConfig, context: TierContext) -> BlockStore:
        # NOTE: imported here, so that reading a configuration imports no store.
        from tiers.memory import DeviceStore

        return DeviceStore(pool=context.pool, name=self.tier_name)
