"""How the engine's OpenMP threads wait between parallel regions: asleep, unless told otherwise.

Why: a step of the batched forward is a few hundred short parallel regions (a product, a layer's
attention) with Python between them on one core. GNU OpenMP's default keeps each worker spinning
for a while after a region, so on a small machine the cores the engine does not use between
regions are still busy, and the server's other threads -- the gRPC and HTTP fronts, the
tokenizer, the tiers' writers -- wait for them. Measured with ``kvgate bench load --configs
kvgate --users 1,4,8`` on a 2-core AMD EPYC, two runs each, alternated (docs/benchmarks.md):
TTFT p50 at 4 users 299 and 276 ms asleep against 316 and 368 spinning, at 8 users 362 and 366
against 466 and 418; req/s 1.23 and 1.23 against 1.14 and 1.10 at 4 users. ``OMP_WAIT_POLICY``
is read once, when the OpenMP runtime loads with torch, so it is set before anything imports
torch; an operator's own setting is kept.
"""

from __future__ import annotations

from collections.abc import MutableMapping

VARIABLE = "OMP_WAIT_POLICY"
DEFAULT = "PASSIVE"


def prefer_sleeping_threads(env: MutableMapping[str, str]) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` in ``env`` (this process's environment, before torch is
    imported) unless it is set already."""
    env.setdefault(VARIABLE, DEFAULT)
