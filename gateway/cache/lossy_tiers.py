"""``[cache] quantize``: which lower tiers may keep lossy (int8, fp8) copies of blocks.

Off by default, per tier, and only for the tiers below the device: the device tier is where
requests read K/V, and it holds exactly what the model computed (promise 1). A lossy tier
keeps its copies in a namespace of its own (``gateway.core.fingerprint.lossy_namespace``), so
an exact request never reads one; docs/design.md, "Lossy tiers", has the whole design.

The codec, the formats and the namespace separation are built and tested; the cache core does
not yet place lossy copies in their own namespace, so a lossy tier wired in today would hold
exact blocks' demoted copies under their exact keys. Until it does, a configuration that turns
one on is refused at start with ``NOT_SERVED`` rather than served wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gateway.core.quantization import EXACT, QUANTIZATIONS, parse_quantization

QUANTIZABLE_TIERS = ("host", "disk", "redis")

NOT_SERVED = (
    "cache.quantize turns on a lossy tier, which this build validates but does not serve yet "
    "(the cache core does not yet keep lossy copies apart from exact blocks: "
    'docs/design.md, "Lossy tiers"); remove cache.quantize, or set every tier to "none"'
)


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
    return errors


def lossy_tiers(quantize: Mapping[str, object]) -> dict[str, str]:
    """The tiers of a valid table that store a lossy format, with that format."""
    return {tier: str(value) for tier, value in quantize.items() if value != EXACT}
