"""Sizes as a configuration writes them: bytes, or a number and a unit (``"512MiB"``).

Every section that takes a size parses it here (``[cache]``, each ``[[cache.tier]]``,
``[engine]``, ``[http]``), so that one spelling means the same everywhere.
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 1000, "kib": KiB, "mb": 1000**2, "mib": MiB, "gb": 1000**3, "gib": GiB,
          "tb": 1000**4, "tib": 1 << 40}


def parse_size(value: object) -> int:
    """Bytes from an integer or a string such as ``"512MiB"`` or ``"2 GB"``.

    Raises:
        ValueError: not a size.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            unit = (match.group(2) or "b").lower()
            return int(float(match.group(1)) * _UNITS[unit])
    raise ValueError(f"{value!r} is not a size: write bytes (1073741824) or e.g. \"1GiB\"")
