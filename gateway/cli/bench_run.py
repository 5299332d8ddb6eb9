"""``kvgate bench ...``: each benchmark's command line turned into its options, run, and its
failures written as one line (``bench_args`` declares the flags; ``gateway.bench`` runs them).

Every benchmark module is imported inside its handler, so that ``kvgate --help`` and the client
commands never load torch or a peer's client.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Mapping

from gateway.cli.common import EXIT_FAILED, EXIT_USAGE, api_key_of
from gateway.cli.numerics_args import resolve_bench_numerics
from gateway.cli.openmp_wait import spin_briefly_then_sleep


def run_bench(args: argparse.Namespace, *, env: Mapping[str, str]) -> int:
    """Run the benchmark ``args.bench`` names; its exit status."""
    if args.bench == "index":
        from gateway.bench.index import run_index_benchmark

        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        run_index_benchmark(sizes=sizes, block_tokens=args.block_tokens,
                            repeats=args.repeats, out=sys.stdout)
        return 0
    if args.bench == "chunks":
        from gateway.bench.chunks import run_chunks_benchmark

        numerics = resolve_bench_numerics(args, command="kvgate bench chunks", err=sys.stderr)
        if isinstance(numerics, int):
            return numerics
        run_chunks_benchmark(model=args.model, cache_dir=args.data_dir / "models",
                             sizes=[int(s) for s in args.sizes.split(",")],
                             prompt_tokens=args.prompt_tokens, repeats=args.repeats,
                             out=sys.stdout, numerics=numerics)
        return 0
    if args.bench == "fairness" and args.lanes:
        from gateway.bench.lanes import LanesOptions, run_lanes_benchmark

        run_lanes_benchmark(LanesOptions(
            model=args.model, cache_dir=args.data_dir / "models", requests=args.requests,
            flood=args.flood, flood_tokens=args.flood_tokens), out=sys.stdout)
        return 0
    if args.bench == "fairness":
        from gateway.bench.fairness import FairnessOptions, run_fairness_benchmark

        run_fairness_benchmark(FairnessOptions(
            model=args.model, cache_dir=args.data_dir / "models", requests=args.requests,
            flood=args.flood, flood_tokens=args.flood_tokens), out=sys.stdout)
        return 0
    if args.bench == "profile":  # the engine runs here: its threads wait as a server's do
        spin_briefly_then_sleep(os.environ)
        from gateway.bench.step_profile import ProfileOptions, run_profile_benchmark

        run_profile_benchmark(ProfileOptions(
            model=args.model, cache_dir=args.data_dir / "models",
            users=[int(u) for u in args.users.split(",")], rounds=args.rounds,
            max_tokens=args.max_tokens), out=sys.stdout)
        return 0
    if args.bench == "tiers":
        from gateway.bench.tiers import run_tiers_benchmark

        numerics = resolve_bench_numerics(args, command="kvgate bench tiers", err=sys.stderr)
        if isinstance(numerics, int):
            return numerics
        args.data_dir.mkdir(parents=True, exist_ok=True)
        run_tiers_benchmark(model=args.model, cache_dir=args.data_dir / "models",
                            repeats=args.repeats, out=sys.stdout, redis_url=args.redis_url,
                            plot=None if args.no_plot else (
                                args.plot or args.data_dir / "bench-tiers.png"),
                            numerics=numerics)
        return 0
    if args.bench == "ttft":
        return _bench_ttft(args, env=env)
    if args.bench == "load":
        return _bench_load(args)
    if args.bench == "metrics":
        return _bench_metrics(args)
    if args.bench == "cluster":
        return _bench_cluster(args)
    if args.bench == "soak":
        return _bench_soak(args)
    if args.bench == "lossy":
        return _bench_lossy(args)
    return EXIT_USAGE


def _bench_ttft(args: argparse.Namespace, *, env: Mapping[str, str]) -> int:
    from gateway.bench.rows import BenchError
    from gateway.bench.ttft import TtftOptions, run_ttft_benchmark
    from gateway.client import KvgateError
    from gateway.engine.models.loading import ModelLoadError

    try:
        lengths = tuple(int(s) for s in args.lengths.split(",") if s.strip())
    except ValueError:
        sys.stderr.write(f"kvgate bench ttft: --lengths {args.lengths!r}: expected integers\n")
        return EXIT_USAGE
    numerics = resolve_bench_numerics(args, command="kvgate bench ttft", err=sys.stderr)
    if isinstance(numerics, int):
        return numerics
    api_key = api_key_of(args.api_key, env, host=args.host,
                         data_dir=None if args.spawn else args.data_dir)
    options = TtftOptions(
        lengths=lengths, suffix_tokens=args.suffix_tokens, repeats=args.repeats,
        block_tokens=args.block_tokens, model=args.model, data_dir=args.data_dir,
        spawn=args.spawn, host=args.host, port=args.port, api_key=api_key,
        admin_key=args.admin_key or env.get("KVGATE_ADMIN_KEY") or None, tenant=args.tenant,
        redis_url=args.redis_url, peers_python=args.peers_python,
        with_peers=not args.no_peers, timeout_s=args.timeout,
        plot=None if args.no_plot else (args.plot or args.data_dir / "bench-ttft.png"),
        numerics=numerics, skip_slow_tiers=args.skip_slow_tiers,
        captured_steps=not args.eager_steps,
    )
    try:
        run_ttft_benchmark(options, out=sys.stdout, err=sys.stderr)
    except (BenchError, KvgateError, ModelLoadError) as exc:
        sys.stderr.write(f"kvgate bench ttft: {exc}\n")
        return EXIT_FAILED
    return 0


def _bench_load(args: argparse.Namespace) -> int:
    from gateway.bench.load import LoadOptions, run_load_benchmark
    from gateway.bench.rows import BenchError
    from gateway.client import KvgateError
    from gateway.engine.models.loading import ModelLoadError

    try:
        users = tuple(int(s) for s in args.users.split(",") if s.strip())
    except ValueError:
        sys.stderr.write(f"kvgate bench load: --users {args.users!r}: expected integers\n")
        return EXIT_USAGE
    numerics = resolve_bench_numerics(args, command="kvgate bench load", err=sys.stderr)
    if isinstance(numerics, int):
        return numerics
    plot = None if args.no_plot else (args.plot or args.data_dir / "bench-load.png")
    options = LoadOptions(
        users=users, rounds=args.rounds,
        configurations=tuple(c.strip() for c in args.configs.split(",") if c.strip()),
        max_tokens=args.max_tokens, num_rules=args.rules,
        block_tokens=args.block_tokens, model=args.model, data_dir=args.data_dir,
        peers_python=args.peers_python, vllm_python=args.vllm_python,
        ignore_eos=args.ignore_eos, with_peers=not args.no_peers, plot=plot,
        timeout_s=args.timeout, numerics=numerics, baseline=args.baseline,
    )
    try:
        run_load_benchmark(options, out=sys.stdout, err=sys.stderr)
    except (BenchError, KvgateError, ModelLoadError, ValueError) as exc:
        sys.stderr.write(f"kvgate bench load: {exc}\n")
        return EXIT_FAILED
    return 0


def _bench_metrics(args: argparse.Namespace) -> int:
    from gateway.bench.metrics_scrape import MetricsBenchOptions, run_metrics_benchmark
    from gateway.bench.rows import BenchError
    from gateway.client import KvgateError
    from gateway.engine.models.loading import ModelLoadError

    numerics = resolve_bench_numerics(args, command="kvgate bench metrics", err=sys.stderr)
    if isinstance(numerics, int):
        return numerics
    options = MetricsBenchOptions(
        users=args.users, rounds=args.rounds, max_tokens=args.max_tokens, num_rules=args.rules,
        interval_s=args.interval_ms / 1e3, idle_s=args.idle_s, block_tokens=args.block_tokens,
        model=args.model, data_dir=args.data_dir, timeout_s=args.timeout, numerics=numerics)
    try:
        run_metrics_benchmark(options, out=sys.stdout, err=sys.stderr)
    except (BenchError, KvgateError, ModelLoadError, ValueError) as exc:
        sys.stderr.write(f"kvgate bench metrics: {exc}\n")
        return EXIT_FAILED
    return 0


def _bench_cluster(args: argparse.Namespace) -> int:
    from gateway.bench.cluster import ClusterOptions, run_cluster_benchmark
    from gateway.bench.rows import BenchError
    from gateway.engine.models.loading import ModelLoadError

    redis = _redis_server("kvgate bench cluster")
    if redis is None:
        return EXIT_FAILED
    options = ClusterOptions(
        smg=args.smg, redis_binary=redis, replicas=args.replicas, families=args.families,
        users=args.users, rounds=args.rounds, max_tokens=args.max_tokens, num_rules=args.rules,
        policies=tuple(p.strip() for p in args.policies.split(",") if p.strip()),
        model=args.model, data_dir=args.data_dir, block_tokens=args.block_tokens,
        timeout_s=args.timeout, restart_router_after=args.restart_router_after,
        router_drain_s=args.router_drain_s)
    try:
        run_cluster_benchmark(options, out=sys.stdout, err=sys.stderr)
    except (BenchError, ModelLoadError, ValueError) as exc:
        sys.stderr.write(f"kvgate bench cluster: {exc}\n")
        return EXIT_FAILED
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    from gateway.bench.rows import BenchError
    from gateway.bench.soak.run import SoakOptions, run_soak

    redis = _redis_server("kvgate bench soak")
    if redis is None:
        return EXIT_FAILED
    options = SoakOptions(redis_binary=redis, redis_cli=shutil.which("redis-cli"),
                          redis_cluster=args.redis_cluster, model=args.model,
                          data_dir=args.data_dir,
                          minutes=args.minutes, replicas=args.replicas, clients=args.clients,
                          fault_every_s=args.fault_every, warmup_s=args.warmup,
                          pause_s=args.pause, max_tokens=args.max_tokens)
    try:
        report = run_soak(options, out=sys.stdout, err=sys.stderr)
    except BenchError as exc:
        sys.stderr.write(f"kvgate bench soak: {exc}\n")
        return EXIT_FAILED
    report.write(sys.stdout)
    if args.json is not None:
        report.save(args.json)
    if not args.no_plot:
        from gateway.bench.soak.plot import plot_soak

        plot = args.plot or (args.json.with_suffix(".png") if args.json is not None
                             else args.data_dir / "bench-soak.png")
        plot_soak(report, plot, sys.stdout)
    return EXIT_FAILED if report.problems() else 0


def _bench_lossy(args: argparse.Namespace) -> int:
    from gateway.bench.lossy import LossyOptions, run_lossy_benchmark
    from gateway.bench.rows import BenchError
    from gateway.engine.models.loading import ModelLoadError

    numerics = resolve_bench_numerics(args, command="kvgate bench lossy", err=sys.stderr)
    if isinstance(numerics, int):
        return numerics
    redis = args.redis_server or shutil.which("redis-server")
    if args.redis_server is not None and not os.access(args.redis_server, os.X_OK):
        sys.stderr.write(f"kvgate bench lossy: --redis-server {args.redis_server}: not an "
                         "executable file\n")
        return EXIT_USAGE
    options = LossyOptions(
        model=args.model, data_dir=args.data_dir, quantization=args.format, tokens=args.tokens,
        repeats=args.repeats, prompts=args.prompts, block_tokens=args.block_tokens,
        redis_binary=redis, numerics=numerics)
    try:
        run_lossy_benchmark(options, out=sys.stdout)
    except (BenchError, ModelLoadError) as exc:
        sys.stderr.write(f"kvgate bench lossy: {exc}\n")
        return EXIT_FAILED
    return 0


def _redis_server(command: str) -> str | None:
    """redis-server's path, or None after saying on stderr that ``command`` needs it."""
    redis = shutil.which("redis-server")
    if redis is None:
        sys.stderr.write(f"{command}: needs redis-server on PATH (Debian's redis-server; "
                         "`make test` installs it)\n")
    return redis
