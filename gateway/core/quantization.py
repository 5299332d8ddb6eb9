"""The lossy K/V formats a lower tier may store, named once for every layer.

A quantized copy of a block is not the block: dequantized, its K/V differ from what the model
computed, so promise 1 (warm == cold, bit for bit) does not hold for anything served from it.
The names here are part of a block's identity (``gateway.core.fingerprint.lossy_namespace``)
and of the stored header (``tiers.block_format``), so they are spelled in one place. What each
format keeps and loses is in ``tiers.kv_quant`` and docs/design.md, "Lossy tiers".
"""

from __future__ import annotations

from typing import Literal, get_args

Quantization = Literal["int8", "fp8"]
"""``int8``: symmetric int8 with one float32 scale per (layer, K or V, KV head, token);
``fp8``: float8 e4m3 with the same scales, where torch supports it on the device."""

QUANTIZATIONS: tuple[Quantization, ...] = get_args(Quantization)

EXACT = "none"
"""The configuration's word for "store exactly what the model computed" (the default)."""


def parse_quantization(value: object) -> Quantization | None:
    """``value`` as a quantization, None for ``"none"``.

    Raises:
        ValueError: anything else, with the words that are allowed.
    """
    if value == EXACT:
        return None
    for name in QUANTIZATIONS:
        if value == name:
            return name
    raise ValueError(f"quantize must be one of {EXACT!r}, "
                     + ", ".join(repr(q) for q in QUANTIZATIONS) + f"; got {value!r}")
