"""The disk tier: one authenticated file per block under a directory of its own, kept over a
restart (``tiers.disk``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from gateway.core.quantization import EXACT, QUANTIZATIONS
from gateway.core.sizes import GiB
from tiers.kinds.base import TierContext, bytes_problem, flag_problems

if TYPE_CHECKING:
    from tiers.base import BlockStore

DISK_PARALLEL_READS = 2
"""Blocks of one load read from the disk tier at once: the file reads and the MAC checks of a
chain's blocks overlap (the reads release the GIL), instead of waiting block after block."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskTierConfig:
    """``[[cache.tier]] kind = "disk"``.

    Attributes:
        bytes: the tier's budget of disk.
        path: where it keeps its files (meant for a local NVMe; ``data_dir/kv`` when a file
            leaves it out).
        fsync: fsync every block file and its directory before it counts as durable.
        write_through: write every new block to disk at once (queued, off the request path),
            so that a restart finds everything, not only what had been demoted.
        quantize: "none" (exact, the default) or the lossy format it stores ("int8", "fp8").
    """

    kind: ClassVar[str] = "disk"
    size_keys: ClassVar[tuple[str, ...]] = ("bytes",)
    path_keys: ClassVar[tuple[str, ...]] = ("path",)
    data_dir_defaults: ClassVar[dict[str, str]] = {"path": "kv"}

    bytes: int = 8 * GiB
    path: Path | None = None
    fsync: bool = True
    write_through: bool = True
    quantize: str = EXACT

    @property
    def budget_bytes(self) -> int:
        return self.bytes

    @property
    def lossy_format(self) -> str | None:
        return None if self.quantize == EXACT else self.quantize

    def problems(self) -> list[str]:
        errors = [p for p in (bytes_problem(self.bytes),) if p]
        if self.path is None:
            errors.append("path is needed: the directory the disk tier keeps its files in")
        errors += flag_problems(self, ("fsync", "write_through"))
        if self.quantize != EXACT and self.quantize not in QUANTIZATIONS:
            errors.append(f"quantize must be {EXACT!r} or one of "
                          f"{', '.join(map(repr, QUANTIZATIONS))}, got {self.quantize!r}")
        return errors


class DiskTier:
    """The disk tier's kind (``tiers.disk.DiskStore``; its ``start`` recovers the files an
    earlier run left, which the cache then adopts)."""

    kind = DiskTierConfig.kind
    tier_name = DiskTierConfig.kind
    config_type = DiskTierConfig
    is_remote = False
    may_be_lossy = True
    queues_writes = True
    is_measured = True
    parallel_reads = DISK_PARALLEL_READS

    def open(self, config: DiskTierConfig, context: TierContext) -> BlockStore:
        # NOTE: imported here, so that reading a configuration imports no store.
        from tiers.disk import DiskStore

        assert config.path is not None  # problems() refuses a disk tier without one
        return DiskStore(config.path, context.codec_for(config.lossy_format),
                         fsync=config.fsync, max_pending_bytes=context.write_queue_bytes,
                         name=self.tier_name)
