"""The local tiers as the cache sees them: one tier (``TierSlot``), and the tiers in their order
with each one's bit in a record's ``tier_mask`` (``TierSlots``).

What ``gateway.cache.placement`` is built over. A record says which tiers hold it in one int,
a bit per tier, fastest first; everything that reads that int -- which tiers hold a block,
which is the fastest, where a victim moves down to, which tier may hold which namespace -- is
here, apart from the rules that change it (placement). Pure reads: no lock, no state but the
tiers given.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from gateway.cache.radix_index import BlockRecord
from gateway.core.errors import IndexInvariantError
from gateway.core.fingerprint import Namespace
from gateway.core.quantization import Quantization
from policies.stack import TierPolicy


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSlot:
    """One tier as the prefix cache sees it: a name, the policy that governs it, and whether
    every inserted block is also written to it at once (write-through: the disk tier, so that
    a restart finds what was hot, not only what had been demoted)."""

    name: str
    policy: TierPolicy
    write_through: bool = False
    keeps_pins: bool = False
    """A restart finds this tier's blocks again (its store recovers them: the disk tier): a
    pinned block gets a copy here, so that the pin outlives the process with it."""
    quantization: Quantization | None = None
    """The lossy format a lower tier stores (``[cache] quantize``), None for exact copies. The
    fastest tier holds pages of every namespace (a lossy request's pages sit beside the exact
    ones, under their lossy keys); a lower tier holds only blocks of namespaces of its own
    format, so an exact block never lands in a lossy tier nor a lossy one in an exact tier
    (docs/design.md, "Lossy tiers")."""


class TierSlots:
    """The local tiers, fastest first, and the bit of each in a record's ``tier_mask``.

    Args:
        tiers: the tiers, fastest first.

    Raises:
        ValueError: no tiers, or duplicate names.
    """

    def __init__(self, tiers: Sequence[TierSlot]) -> None:
        if not tiers:
            raise ValueError("a prefix cache needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self._tiers = tuple(tiers)
        self._bit_of = {t.name: 1 << i for i, t in enumerate(tiers)}

    def __iter__(self) -> Iterator[TierSlot]:
        return iter(self._tiers)

    @property
    def bit_of(self) -> Mapping[str, int]:
        """Each tier's bit, by name, fastest first (read on the hot paths: no call per bit)."""
        return MappingProxyType(self._bit_of)

    @property
    def names(self) -> tuple[str, ...]:
        """The tiers' names, fastest first."""
        return tuple(t.name for t in self._tiers)

    @property
    def write_through(self) -> tuple[str, ...]:
        """Tiers that receive a copy of every newly inserted block."""
        return tuple(t.name for t in self._tiers if t.write_through)

    @property
    def lossy(self) -> tuple[str, ...]:
        """Lower tiers that store lossy copies, fastest first."""
        return tuple(t.name for t in self._tiers if t.quantization is not None)

    def slot(self, tier: str) -> TierSlot:
        """The tier named ``tier`` (ValueError, naming the tiers, if there is none)."""
        bit = self._bit_of.get(tier)
        if bit is None:
            raise ValueError(f"unknown tier {tier!r}; tiers are {list(self._bit_of)}")
        return self._tiers[bit.bit_length() - 1]

    def accepts(self, tier: str, namespace: Namespace) -> bool:
        """Whether ``tier`` may hold blocks of ``namespace`` (see ``TierSlot.quantization``)."""
        slot = self.slot(tier)
        return slot is self._tiers[0] or slot.quantization == namespace.quantization

    def holding(self, record: BlockRecord) -> Iterator[TierSlot]:
        """The tiers holding a copy of ``record``, fastest first."""
        return (t for t in self._tiers if record.tier_mask & self._bit_of[t.name])

    def fastest(self, record: BlockRecord) -> str:
        """The fastest tier holding ``record``.

        Raises:
            IndexInvariantError: no tier holds it.
        """
        for tier in self.holding(record):
            return tier.name
        raise IndexInvariantError("a block in the index is held by no tier")

    def holding_any(self, records: Iterable[BlockRecord]) -> tuple[str, ...]:
        """The tiers, fastest first, holding at least one of ``records``."""
        mask = 0
        for record in records:
            mask |= record.tier_mask
        return tuple(t.name for t in self._tiers if mask & self._bit_of[t.name])

    def below(self, tier: str, namespace: Namespace) -> str | None:
        """The tier a block of ``namespace`` leaving ``tier`` moves down into: the next slower
        one that holds blocks of its namespace (an exact block skips a lossy tier, a lossy one
        an exact tier); None where there is none."""
        for slot in self._tiers[self._bit_of[tier].bit_length():]:
            if self.accepts(slot.name, namespace):
                return slot.name
        return None
