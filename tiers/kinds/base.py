"""The seam of a tier *kind*: a configuration record, and how a store is opened from it.

A tier kind (device, host, quantized host, disk, Redis, ...) is one class in one module of this
package, plus one line in ``tiers.kinds.registry.TIER_KINDS``. It names:

* ``config_type``: a frozen record of its own keys (those of one ``[[cache.tier]]`` table), with
  ``problems()``: what is wrong with it, one line each, the key named;
* ``open(config, context)``: its store (``tiers.base.BlockStore``), built from the record and
  what every tier shares (``TierContext``: the model's layout, the device, the page pool, the
  codecs);
* whether it is remote (shared by replicas: consulted after the local tiers, written through),
  may be lossy (``lossy_format``), keeps a write queue that holds pool pages, or may load slower
  than recomputing (measured before serving).

The records import no store: ``gateway.config`` reads them without opening anything. A kind's
``open`` imports its store where it runs (``NOTE:`` in each module), so that parsing a file
never imports a store, a file system layer or the Redis client.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from gateway.core.sizes import parse_size

if TYPE_CHECKING:
    import torch

    from tiers.base import BlockStore
    from tiers.codec import BlockCodec
    from tiers.page_pool import PagePool
    from tiers.payload import KVLayout
    from tiers.redis_events import RedisEventLog


class TierConfig(Protocol):
    """One tier's record: its own keys, checked by itself."""

    kind: ClassVar[str]
    size_keys: ClassVar[tuple[str, ...]]
    """Keys that are sizes (bytes, or ``"8GiB"``)."""
    path_keys: ClassVar[tuple[str, ...]]
    """Keys that are paths (``~`` expanded)."""

    @property
    def budget_bytes(self) -> int | None:
        """The most bytes the tier holds (its eviction policy's budget); None: the store
        bounds itself (Redis: a TTL and its own memory policy)."""
        ...

    @property
    def lossy_format(self) -> str | None:
        """The lossy format the tier stores (``gateway.core.quantization``), or None: exact."""
        ...

    @property
    def write_through(self) -> bool:
        """Every new block is written here at once (queued), not only what is demoted."""
        ...

    def problems(self) -> list[str]:
        """Every problem with this record, one line each, naming the key."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class TierContext:
    """What every tier of one cache shares, built once by ``gateway.cache.operations.factory``.

    Attributes:
        layout: the model's KV layout.
        block_tokens: tokens per block.
        device: where the model runs (the device tier lives there; the host tier pins its
            memory and serves there exactly when it is a GPU).
        pool: the device's page pool (the device tier's blocks are its pages).
        codec_for: the block codec writing a format (None: exact), one per format.
        write_queue_bytes: bound of each store's own write queue.
        clock: monotonic seconds.
    """

    layout: KVLayout
    block_tokens: int
    device: torch.device
    pool: PagePool
    codec_for: Callable[[str | None], BlockCodec]
    write_queue_bytes: int
    clock: Callable[[], float]


class TierKind(Protocol):
    """A kind of tier: its record type and how a store is opened from one."""

    kind: str
    """Its name in ``[[cache.tier]] kind = "..."``."""
    tier_name: str
    """What the cache calls the tier it opens (stats, usage, quotas, ``quantize``)."""
    config_type: type[Any]
    """Its ``TierConfig`` record."""
    is_remote: bool
    """Shared by replicas: read after every local tier, never a slot of its own."""
    may_be_lossy: bool
    queues_writes: bool
    """Its writes wait in a queue of its own that holds the device pool's pages until
    encoded (``gateway.cache.operations.factory.queued_write_bytes``)."""
    is_measured: bool
    """Its loads may be slower than recomputing: measured before serving."""
    parallel_reads: int
    """Blocks of one load read from it at once."""

    def open(self, config: Any, context: TierContext) -> BlockStore:
        """The tier's store, not yet started (``start()`` where it has one)."""
        ...


class RemoteTierKind(TierKind, Protocol):
    """A remote kind also opens the replicas' event stream."""

    def open_events(self, config: Any) -> RedisEventLog:
        """The stream replicas tell each other their evictions on."""
        ...


def is_seconds(value: object) -> bool:
    """A finite number of seconds > 0 (not a ``bool``)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def bytes_problem(value: object, *, key: str = "bytes") -> str | None:
    """What is wrong with a tier's byte budget (an integer > 0), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{key} must be a size > 0 (bytes, or e.g. \"8GiB\"), got {value!r}"
    return None


def flag_problems(record: object, names: tuple[str, ...]) -> list[str]:
    """The keys of ``names`` that are not true or false."""
    return [f"{name} must be true or false, got {getattr(record, name)!r}" for name in names
            if not isinstance(getattr(record, name), bool)]


def record_from_table(config_type: type[Any], table: Mapping[str, object], where: str,
                      *, data_dir: Path | None = None) -> tuple[Any, list[str]]:
    """A record of ``config_type`` from one ``[[cache.tier]]`` table, and every problem with it
    (the record is None where it could not be built).

    Sizes and paths are parsed here, by the section, so that a message names the key as the
    file spells it (``cache.tier[1].bytes``). A path key left out of the table takes the
    record's default under ``data_dir`` (``data_dir_defaults``)."""
    known = {f.name for f in fields(config_type)}
    errors: list[str] = []
    unknown = sorted(set(table) - known - {"kind"})
    if unknown:
        errors.append(f"{where} has unknown keys {unknown}; known: {sorted(known | {'kind'})}")
    values: dict[str, object] = {}
    for name, value in table.items():
        if name not in known:
            continue
        try:
            if name in config_type.size_keys:
                value = parse_size(value)
            elif name in config_type.path_keys and value is not None:
                value = Path(str(value)).expanduser()
        except ValueError as exc:
            errors.append(f"{where}.{name}: {exc}")
            continue
        values[name] = value
    defaults: Mapping[str, str] = getattr(config_type, "data_dir_defaults", {})
    for name, below in defaults.items():
        if values.get(name) is None and data_dir is not None:
            values[name] = data_dir / below
    if errors:
        return None, errors
    try:
        record = config_type(**values)
    except TypeError as exc:
        return None, [f"{where}: {exc}"]
    return record, [f"{where}.{problem}" for problem in record.problems()]
