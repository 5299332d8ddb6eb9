"""Every tier kind by its name in ``[[cache.tier]] kind = "..."``: adding a tier is one module
in this package and one line here.

The device kind is always there and first (its page pool holds the running requests' pages);
``tier_list_problems`` says so for a list that omits or moves it, names an unknown kind, names
one tier twice, or puts a remote tier before a local one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tiers.kinds.base import TierKind
from tiers.kinds.device import DeviceTier
from tiers.kinds.disk import DiskTier
from tiers.kinds.host import HostTier
from tiers.kinds.quantized_host import QuantizedHostTier
from tiers.kinds.remote import RedisTier

TIER_KINDS: dict[str, TierKind] = {kind.kind: kind for kind in (
    DeviceTier(),
    HostTier(),
    QuantizedHostTier(),
    DiskTier(),
    RedisTier(),
)}
FIRST_KIND = DeviceTier.kind
"""The kind every tier list starts with."""


def kind_of(name: object, kinds: Mapping[str, TierKind] = TIER_KINDS) -> TierKind:
    """The kind called ``name``.

    Raises:
        ValueError: no such kind, in one line listing the known ones.
    """
    kind = kinds.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"unknown tier kind {name!r}; known: {', '.join(sorted(kinds))}")
    return kind


def tier_list_problems(names: Sequence[str],
                       kinds: Mapping[str, TierKind] = TIER_KINDS) -> list[str]:
    """What is wrong with an ordered list of tier kinds (by name) as a whole, one line each."""
    unknown = [name for name in names if name not in kinds]
    if unknown:
        return [f"unknown tier kind {name!r}; known: {', '.join(sorted(kinds))}"
                for name in unknown]
    if not names or names[0] != FIRST_KIND:
        return [f"the tiers must start with the {FIRST_KIND} tier (its page pool holds the "
                f"running requests' pages), got {names}"]
    errors = []
    tier_names = [kinds[name].tier_name for name in names]
    twice = sorted({name for name in tier_names if tier_names.count(name) > 1})
    if twice:
        errors.append(f"the tiers name the {', '.join(twice)} tier more than once: {names}")
    remote = [kinds[name].is_remote for name in names]
    if any(remote[i] and not remote[i + 1] for i in range(len(remote) - 1)):
        errors.append(f"a remote tier comes after every local one, got {names}")
    if sum(remote) > 1:
        errors.append(f"at most one remote tier, got {names}")
    return errors
