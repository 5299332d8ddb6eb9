"""The two-sample Kolmogorov–Smirnov test, exact, for the timing audits
(docs/reliability.md, group D).

scipy is not a dependency of kvgate; the exact two-sided p-value for samples without ties is a
count of lattice paths (Hodges 1958), a few lines with Python's integers: of the C(n+m, n)
equally likely orders of the pooled sample under the null hypothesis, the share whose empirical
distributions never differ by as much as the observed D.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb


def ks_two_sample(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """The statistic D = sup |F_x - F_y| and its exact two-sided p-value.

    Raises:
        ValueError: an empty sample.
    """
    n, m = len(x), len(y)
    if not n or not m:
        raise ValueError("both samples need at least one value")
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    i = j = 0
    d_max = 0  # in units of 1 / (n m): |i m - j n| at each step
    k = 0
    while k < len(pooled):
        value = pooled[k][0]
        while k < len(pooled) and pooled[k][0] == value:  # ties move together
            if pooled[k][1] == 0:
                i += 1
            else:
                j += 1
            k += 1
        d_max = max(d_max, abs(i * m - j * n))
    # Paths from (0, 0) to (n, m) that stay strictly inside |i m - j n| < d_max.
    row = [0] * (m + 1)
    for a in range(n + 1):
        for b in range(m + 1):
            if abs(a * m - b * n) >= d_max:
                row[b] = 0
            elif a == 0 and b == 0:
                row[b] = 1
            else:
                row[b] = (row[b] if a > 0 else 0) + (row[b - 1] if b > 0 else 0)
    inside = row[m]
    p_value = 1.0 - inside / comb(n + m, n)
    return d_max / (n * m), max(0.0, min(1.0, p_value))
