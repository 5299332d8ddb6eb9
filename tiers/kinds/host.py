"""The host tier: exact blocks in CPU memory (pinned where the model runs on a GPU)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from gateway.core.sizes import GiB
from tiers.kinds.base import TierContext, bytes_problem, flag_problems

if TYPE_CHECKING:
    from tiers.base import BlockStore

logger = logging.getLogger(__name__)

HOST = "host"
"""The host tier's name: the one place it is spelled (its quantized kind shares it)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostTierConfig:
    """``[[cache.tier]] kind = "host"``.

    Attributes:
        bytes: the tier's budget of CPU memory.
        layered_loads: on a GPU, a hit is copied into its pages layer by layer on a stream of
            its own, and a step waits for each layer only before it reads it
            (``tiers.layer_arrivals``). Off by default until timed on a GPU; on a CPU it copies
            the same bytes at once (no gain there).
    """

    kind: ClassVar[str] = HOST
    size_keys: ClassVar[tuple[str, ...]] = ("bytes",)
    path_keys: ClassVar[tuple[str, ...]] = ()

    bytes: int = 4 * GiB
    layered_loads: bool = False

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
        return [p for p in (problem,) if p] + flag_problems(self, ("layered_loads",))


class HostTier:
    """The host tier's kind (``tiers.memory.HostStore``)."""

    kind = HOST
    tier_name = HOST
    config_type = HostTierConfig
    is_remote = False
    may_be_lossy = False
    queues_writes = False
    is_measured = False
    parallel_reads = 1

    def open(self, config: HostTierConfig, context: TierContext) -> BlockStore:
        # NOTE: imported here, so that reading a configuration imports no store.
        from tiers.layer_arrivals import LayerArrivals, LayeredLoadsUnavailable
        from tiers.memory import HostStore

        if config.layered_loads:
            try:
                context.pool.arrivals = LayerArrivals(context.pool)
            except LayeredLoadsUnavailable as error:
                logger.warning("layered_host_loads is on, but host-tier hits are copied "
                               "whole: %s", error)
        return HostStore(layout=context.layout, block_tokens=context.block_tokens,
                         budget_bytes=config.bytes, pin=context.device.type == "cuda",
                         serve_device=context.device, name=self.tier_name)
