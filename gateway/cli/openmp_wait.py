"""How the engine's OpenMP threads wait between parallel regions: a short spin, then asleep,
unless told otherwise.

Why asleep: a step of the batched forward is a few hundred short parallel regions (a product, a
layer's attention) with Python between them on one core. GNU OpenMP's default keeps each worker
spinning for up to 300,000 pauses after a region, so on a small machine the cores the engine
does not use between steps are still busy, and the server's other threads -- the gRPC and HTTP
fronts, the tokenizer, the tiers' writers -- wait for them. Measured with ``kvgate bench load
--configs kvgate --users 1,4,8`` on a 2-core AMD EPYC, two runs each, alternated
(docs/benchmarks.md): TTFT p50 at 4 users 299 and 276 ms asleep against 316 and 368 spinning,
at 8 users 362 and 366 against 466 and 418; req/s 1.23 and 1.23 against 1.14 and 1.10 at 4 users.

Why a short spin first: asleep, each region of a step pays a worker's wake-up. 30,000 pauses --
0.3 ms on the 2-core Intel Xeon we measured on (10 ns a pause), a few times that on CPUs with a
slower pause -- outlast the Python between a step's regions and end soon after the step.
Side by side in one run (``kvgate bench load --configs kvgate,baseline --users 1,4,8``, the
same Xeon, 2026-11-29): req/s 1.16x at 4 and 8 users, latency p50 0.86x, against threads that
slept at once; 10,000 pauses gave 1.06x, 100,000 1.15-1.17x. The spin only happens where the
engine's team is the process's only one (``gateway.engine.native.openmp_team``).

Both are read once, when the OpenMP runtime loads with torch, so they are set before anything
imports torch; an operator's own setting of either is kept (``GOMP_SPINCOUNT`` would override an
operator's ``OMP_WAIT_POLICY``, so it is added only where the policy is ours).
"""

from __future__ import annotations

from collections.abc import MutableMapping

POLICY = "OMP_WAIT_POLICY"
SPIN_COUNT = "GOMP_SPINCOUNT"
DEFAULTS = {POLICY: "PASSIVE", SPIN_COUNT: "30000"}


def spin_briefly_then_sleep(env: MutableMapping[str, str]) -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` and ``GOMP_SPINCOUNT=30000`` in ``env`` (this process's
    environment, before torch is imported), unless the operator set either."""
    if POLICY in env or SPIN_COUNT in env:
        return
    env.update(DEFAULTS)
