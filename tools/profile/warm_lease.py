"""What the cache's own bookkeeping costs a warm request: acquire, load and release of a chain.

    PYTHONPATH=. .venv/bin/python tools/profile/warm_lease.py [ROOT ...] [--blocks N,M] [--runs K]

ROOT: a checkout to time (default: this one); name two (this one and a ``git worktree`` of an
earlier commit) to compare them side by side, each in a process of its own, alternately, twice.
Each process builds a prefix cache over a device tier (a page pool) and a host tier, stores a
chain of N blocks of 64 tokens, then times ``acquire`` + ``load`` + release: K times with the
chain in the device tier, and K/3 times with it in the host tier only (evicted from the device
before each, so each load promotes it back). The blocks are tiny (2 layers, 1 head of 4): what
is timed is the index, the plan, the settlement and the moves, not copying bytes. Medians, in
microseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def measure(num_blocks: int, runs: int) -> tuple[float, float]:
    """Median seconds of a warm lease from the device tier, and from the host tier."""
    import torch

    from gateway.cache.prefix_cache import PrefixCache, TierSlot
    from gateway.core.fingerprint import NamespaceSpec, Scope, derive_namespace
    from gateway.core.tokens import as_token_ids
    from policies.registry import TierPolicyConfig, build_tier_policy
    from tiers.hierarchy import TierHierarchy, TierLevel
    from tiers.memory import DeviceStore, HostStore
    from tiers.page_pool import PagePool
    from tiers.payload import KVBlock, KVLayout

    torch.set_num_threads(1)
    layout = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
    block_tokens, num_pages = 64, 2 * num_blocks + 8
    namespace = derive_namespace(NamespaceSpec(
        deployment_secret=b"k" * 32, model_fingerprint="warm-lease", kv_dtype="float32",
        device_kind="cpu", scope=Scope.of_tenant("a")))
    budget = num_pages * layout.block_nbytes(block_tokens)
    pool = PagePool(layout, page_tokens=block_tokens, num_pages=num_pages, device="cpu")
    hierarchy = TierHierarchy([
        TierLevel(name="device", store=DeviceStore(pool=pool)),
        TierLevel(name="host", store=HostStore(layout=layout, block_tokens=block_tokens,
                                               budget_bytes=budget))])
    cache = PrefixCache(block_tokens=block_tokens, hierarchy=hierarchy, tiers=[
        TierSlot(name=name, policy=build_tier_policy(TierPolicyConfig(budget_bytes=budget)))
        for name in ("device", "host")])
    tokens = as_token_ids(list(range(1, num_blocks * block_tokens + 2)))
    shape = (1, block_tokens, 4)
    with cache.acquire(namespace, tokens) as lease:
        cache.insert(lease, tier="device", blocks=[
            KVBlock(keys=tuple(torch.randn(shape) for _ in range(2)),
                    values=tuple(torch.randn(shape) for _ in range(2)))
            for _ in range(num_blocks)])

    def one() -> float:
        start = time.perf_counter()
        with cache.acquire(namespace, tokens) as lease:
            loaded = cache.load(lease)
        elapsed = time.perf_counter() - start
        assert len(loaded) == num_blocks, "the chain did not load whole"
        return elapsed

    device = statistics.median(one() for _ in range(runs))
    from_host = []
    for _ in range(max(1, runs // 3)):
        cache.evict("device", budget)
        from_host.append(one())
    hierarchy.close()
    return device, statistics.median(from_host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[HERE])
    parser.add_argument("--blocks", default="27,128",
                        help="chain lengths in blocks of 64 tokens (default: 27,128)")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    blocks = [int(n) for n in args.blocks.split(",")]
    if args.child:
        for n in blocks:
            device, host = measure(n, args.runs)
            print(f"  {n:>4} blocks: device {device * 1e6:,.0f} us, host {host * 1e6:,.0f} us")
        return
    roots = [root.resolve() for root in args.roots]
    for round_index in range(2 if len(roots) > 1 else 1):
        for root in roots:
            print(f"{root} (round {round_index + 1})", flush=True)
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                            "--blocks", args.blocks, "--runs", str(args.runs)],
                           cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, check=True)


if __name__ == "__main__":
    main()
