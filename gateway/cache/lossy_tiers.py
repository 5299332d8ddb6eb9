"""``[cache] quantize``: which lower tiers may keep lossy (int8, fp8) copies of blocks.

Off by default, per tier, and only for the tiers below the device: the device tier is where
requests read K/V, as the model computed it (a request that opted into lossy copies reads their
dequantized pages there too, under their own keys). A lossy tier keeps its copies in a namespace
of its own (``gateway.core.fingerprint.lossy_namespace``), so an exact request never reads one;
docs/design.md, "Lossy tiers", has the whole design.

One format per deployment: a prefix has one lossy namespace, and its copies live in every tier
of that format (a chain read from one lossy tier can be continued from another).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gateway.core.quantization import EXACT, QUANTIZATIONS, parse_quantization
from tiers.kinds.registry import TIER_KINDS

QUANTIZABLE_TIERS = tuple(dict.fromkeys(kind.tier_name for kind in TIER_KINDS.values()
                                        if kind.may_be_lossy))
"""The tiers a kind of which may be lossy: host, disk, redis."""


def quantize_problems(quantize: Mapping[str, object]) -> list[str]:
    """Every problem with a ``tier = format`` table, for one message listing them all."""
    errors = []
    for tier, value in quantize.items():
        if tier == "device":
            errors.append("quantize names the device tier, which always holds the K/V "
                          "the model computed (requests read it there); quantizable tiers: "
                          + ", ".join(QUANTIZABLE_TIERS))
            continue
        if tier not in QUANTIZABLE_TIERS:
            errors.append(f"quantize names the tier {tier!r}; quantizable tiers: "
                          + ", ".join(QUANTIZABLE_TIERS))
            continue
        try:
            quantization = parse_quantization(value)
        except ValueError:
            errors.append(f"quantize.{tier} must be one of {EXACT!r}, "
                          + ", ".join(repr(q) for q in QUANTIZATIONS) + f"; got {value!r}")
            continue
        if quantization == "fp8" and not isinstance(getattr(torch, "float8_e4m3fn", None),
                                                    torch.dtype):
            errors.append(f"quantize.{tier} = 'fp8' needs float8 dtypes, which torch "
                          f"{torch.__version__} lacks: use 'int8'")
    formats = sorted(set(lossy_tiers({t: v for t, v in quantize.items()
                                      if t in QUANTIZABLE_TIERS and v in QUANTIZATIONS}).values()))
    if len(formats) > 1:
        errors.append(f"quantize names {' and '.join(formats)}: the lossy tiers must share one "
                      "format (a prefix has one lossy namespace, whose copies every lossy tier "
                      "serves)")
    return errors


def lossy_tiers(quantize: Mapping[str, object]) -> dict[str, str]:
    """The tiers of a valid table that store a lossy format, with that format."""
    return {tier: str(value) for tier, value in quantize.items() if value != EXACT}
