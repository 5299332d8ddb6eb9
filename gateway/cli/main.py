"""The ``kvgate`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

from gateway.cli.bench_args import (
    add_bench_cluster,
    add_bench_load,
    add_bench_lossy,
    add_bench_metrics,
    add_bench_soak,
    add_bench_ttft,
)
from gateway.cli.common import EXIT_FAILED, EXIT_USAGE, api_key_of, read_messages
from gateway.cli.numerics_args import add_numerics_arguments
from gateway.cli.openmp_wait import spin_briefly_then_sleep


def _version() -> str:
    """The installed package's version (pyproject.toml's, through the package metadata)."""
    try:
        return metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="Prefix-caching gateway for LLMs.")
    parser.add_argument("--version", action="version", version=f"kvgate {_version()}",
                        help="print the installed kvgate's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark and print its figures")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    index = bench_sub.add_parser("index", help="fingerprint, radix index and eviction figures")
    index.add_argument("--sizes", default="10000,100000,1000000",
                       help="comma-separated index sizes in blocks (default: %(default)s)")
    index.add_argument("--block-tokens", type=int, default=64,
                       help="tokens per block (default: %(default)s)")
    index.add_argument("--repeats", type=int, default=2000,
                       help="timed lookups per prompt length (default: %(default)s)")
    chunks = bench_sub.add_parser("chunks", help="cold prefill time by chunk size on the "
                                  "batched forward, beside transformers (to choose step_tokens)")
    chunks.add_argument("--model", default="bundled",
                        help="'bundled' (SmolLM2-135M) or a checkpoint directory")
    chunks.add_argument("--data-dir", type=Path, default=Path("data"),
                        help="model conversion cache (DATA_DIR/models) (default: %(default)s)")
    chunks.add_argument("--sizes", default="64,128,256,512,1024",
                        help="comma-separated chunk sizes in tokens (default: %(default)s)")
    chunks.add_argument("--prompt-tokens", type=int, default=2048,
                        help="tokens of the prompt prefilled (default: %(default)s)")
    chunks.add_argument("--repeats", type=int, default=3,
                        help="timed prefills per size; the table shows medians (default: "
                             "%(default)s)")
    add_numerics_arguments(chunks, what="the model and its K/V")
    fairness = bench_sub.add_parser("fairness", help="one tenant's TTFT alone and while another "
                                    "tenant floods the engine (in process)")
    fairness.add_argument("--model", default="bundled",
                          help="'bundled' (SmolLM2-135M) or a checkpoint directory")
    fairness.add_argument("--data-dir", type=Path, default=Path("data"),
                          help="model conversion cache (DATA_DIR/models) (default: "
                               "%(default)s)")
    fairness.add_argument("--requests", type=int, default=12,
                          help="the quiet tenant's requests per phase (default: %(default)s)")
    fairness.add_argument("--flood", type=int, default=8,
                          help="the flooding tenant's requests in flight (default: %(default)s)")
    fairness.add_argument("--flood-tokens", type=int, default=1024,
                          help="prompt words per flood request (default: %(default)s)")
    fairness.add_argument("--lanes", action="store_true",
                          help="priority lanes inside one tenant instead: 2 interactive users "
                               "alone, then beside --flood bulk users at the same priority and "
                               "at a worse one (issue 28)")
    profile = bench_sub.add_parser("profile", help="where the engine's thread spends the chat "
                                   "load's time, sampled, and the cores busy (in process)")
    profile.add_argument("--model", default="bundled",
                         help="'bundled' (SmolLM2-135M) or a checkpoint directory")
    profile.add_argument("--data-dir", type=Path, default=Path("data"),
                         help="model conversion cache (DATA_DIR/models) (default: %(default)s)")
    profile.add_argument("--users", default="1,8",
                         help="comma-separated user counts, run in turn (default: %(default)s)")
    profile.add_argument("--rounds", type=int, default=4,
                         help="questions each user asks in turn (default: %(default)s)")
    profile.add_argument("--max-tokens", type=int, default=32,
                         help="greedy tokens per answer (default: %(default)s)")
    tiers = bench_sub.add_parser("tiers", help="put/get of a real prefix per tier vs raw limits")
    tiers.add_argument("--model", default="bundled",
                       help="'bundled' (SmolLM2-135M) or a checkpoint directory")
    tiers.add_argument("--data-dir", type=Path, default=Path("data"),
                       help="model conversion cache and scratch files (default: %(default)s)")
    tiers.add_argument("--repeats", type=int, default=5,
                       help="timed puts and gets per tier; the table shows medians (default: "
                            "%(default)s)")
    tiers.add_argument("--redis-url", default=None,
                       help="use this Redis instead of starting a redis-server on loopback")
    tiers.add_argument("--plot", type=Path, default=None,
                       help="PNG of the table (default: DATA_DIR/bench-tiers.png)")
    tiers.add_argument("--no-plot", action="store_true", help="write no PNG")
    add_numerics_arguments(tiers, what="the model, its K/V and the device tier")
    add_bench_ttft(bench_sub)
    add_bench_load(bench_sub)
    add_bench_metrics(bench_sub)
    add_bench_cluster(bench_sub)
    add_bench_soak(bench_sub)
    add_bench_lossy(bench_sub)
    _add_serve(sub)
    _add_generate(sub)
    config = sub.add_parser("config", help="the configuration file of `kvgate serve`")
    config_sub = config.add_subparsers(dest="config", required=True)
    config_sub.add_parser("example", help="print a commented example kvgate.toml")
    from gateway.cli.admin import add_admin_parser
    from gateway.cli.explain import add_explain_parser
    from gateway.cli.prewarm import add_prewarm_parser

    add_explain_parser(sub)
    add_prewarm_parser(sub)
    add_admin_parser(sub)
    return parser


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", help="run the gateway (gRPC kvgate.v1, health, reflection; the "
                      "OpenAI-compatible HTTP API beside it)",
        description="Run the gateway until SIGTERM or Ctrl-C. With no API keys configured "
                    "(config file, KVGATE_API_KEYS, KVGATE_ADMIN_KEYS) a development key for "
                    "tenant 'default' is created, printed and kept in DATA_DIR/dev-api-key.")
    serve.add_argument("--config", type=Path, default=None,
                       help="a .toml or .json configuration (see gateway/config/loader.py)")
    serve.add_argument("--host", default=None, help="listen address (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default: 50051)")
    serve.add_argument("--data-dir", type=Path, default=None,
                       help="disk tier, model cache, secret and dev key (default: data)")
    serve.add_argument("--model", default=None,
                       help="'bundled' (SmolLM2-135M-Instruct, the default) or a checkpoint "
                            "directory")
    serve.add_argument("--device", default=None,
                       help="where the model and the device tier live: auto (the first GPU if "
                            "torch sees one, else the CPU; the default), cpu, cuda or cuda:N")
    serve.add_argument("--dtype", default=None,
                       help="what the model computes and the cache stores K/V in: auto "
                            "(bfloat16 on a GPU, float32 on the CPU; the default), float32, "
                            "bfloat16 or float16 (half precision is slow on most CPUs)")
    serve.add_argument("--http-host", default=None,
                       help="the OpenAI-compatible HTTP API's address (default: 127.0.0.1)")
    serve.add_argument("--http-port", type=int, default=None,
                       help="its port (default: 8000; 0 picks a free one)")
    serve.add_argument("--no-http", action="store_const", const=False, default=None,
                       dest="http_enabled", help="serve gRPC only")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model id the OpenAI-compatible API reports (/v1/models, "
                            "responses) and accepts in requests; more names are aliases a "
                            "request may use (default: the --model directory's name, or "
                            "'bundled'; [http] served_model_name)")
    serve.add_argument("--allow-insecure-remote", action="store_true", default=None,
                       help="listen on a non-loopback address without TLS (API keys travel "
                            "in the clear: only behind a TLS-terminating proxy)")
    serve.add_argument("--log-level", default="INFO",
                       choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="the least severe log records written to stderr (default: "
                            "%(default)s)")


def _add_generate(sub: Any) -> None:
    gen = sub.add_parser(
        "generate", help="send one prompt to a running gateway and stream the answer",
        description="Writes only the generated text to stdout, and one usage line "
                    "(cached_tokens=N, per tier, ttft_ms=...) to stderr.")
    gen.add_argument("prompt", nargs="?", default=None,
                     help="the prompt, sent as a user message through the model's chat "
                          "template (with --messages: appended as a last user message; "
                          "with --raw: sent as raw text)")
    gen.add_argument("--raw", action="store_true",
                     help="send PROMPT as raw text (completion) instead of a user message")
    gen.add_argument("--host", default="127.0.0.1",
                     help="the gateway's address (default: %(default)s)")
    gen.add_argument("--port", type=int, default=50051,
                     help="its gRPC port, [server] port (default: %(default)s; not the HTTP "
                          "API's)")
    gen.add_argument("--api-key", default=None,
                     help="API key (default: $KVGATE_API_KEY, else DATA_DIR/dev-api-key for a "
                          "gateway on this machine); other users can see it in `ps`, so "
                          "prefer the environment variable")
    gen.add_argument("--data-dir", type=Path, default=Path("data"),
                     help="where `kvgate serve` keeps dev-api-key (default: %(default)s)")
    gen.add_argument("--messages", type=Path, default=None,
                     help="a JSON file: a list of {role, content}, or {messages, tools}")
    gen.add_argument("--max-tokens", type=int, default=None,
                     help="the most tokens to generate (default: the server's, 256)")
    gen.add_argument("--temperature", type=float, default=None,
                     help="sampling temperature; 0 is greedy (default: the server's, greedy)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="nucleus sampling: keep the most likely tokens up to this "
                          "probability mass")
    gen.add_argument("--top-k", type=int, default=None,
                     help="sample among the K most likely tokens only")
    gen.add_argument("--seed", type=int, default=None,
                     help="seed of the sampler, for a repeatable sampled answer")
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--no-cache", action="store_true",
                     help="nothing of this request is read from or stored in any tier")
    gen.add_argument("--allow-lossy", action="store_true",
                     help="the prompt may be read from lossy (int8/fp8) copies where the "
                          "gateway keeps them: faster from a lower tier, but the answer may "
                          "differ from the model's own (the usage line then says lossy=yes)")
    gen.add_argument("--priority", type=int, default=None,
                     help="lower is served first among your tenant's own requests, -1000 to "
                          "1000 (default: the server's, 0)")
    gen.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    gen.add_argument("--tls", action="store_true", help="connect with TLS")
    gen.add_argument("--ca-cert", type=Path, default=None,
                     help="PEM of the CA that signed the gateway's certificate")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        from gateway.cli.bench_run import run_bench

        return run_bench(args, env=os.environ)
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        return _generate(args, out=sys.stdout, err=sys.stderr, env=os.environ)
    if args.command == "config" and args.config == "example":
        from gateway.config.example import EXAMPLE_CONFIG

        sys.stdout.write(EXAMPLE_CONFIG)
        return 0
    if args.command == "prewarm":
        from gateway.cli.prewarm import run_prewarm

        return run_prewarm(args, out=sys.stdout, err=sys.stderr, env=os.environ)
    if args.command == "explain":
        from gateway.cli.explain import run_explain

        return run_explain(args, out=sys.stdout, err=sys.stderr, env=os.environ)
    if args.command == "admin":
        from gateway.cli.admin import run_admin

        return run_admin(args, out=sys.stdout, err=sys.stderr, env=os.environ)
    return EXIT_USAGE


def _serve(args: argparse.Namespace) -> int:
    spin_briefly_then_sleep(os.environ)  # before anything imports torch
    from gateway.config.loader import load_serve_config
    from gateway.config.settings import ConfigError
    from gateway.core.errors import GatewayError
    from gateway.engine.models.loading import UnservableModel
    from gateway.service.assembly import serve
    from gateway.service.server import ServeError
    from gateway.service.startup import StartInterrupted, StopSignals

    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn's own INFO lines ("Started server process") describe a process of its own that the
    # HTTP front does not have; its warnings and errors still show.
    logging.getLogger("uvicorn.error").setLevel(
        max(logging.WARNING, logging.getLevelName(args.log_level)))
    try:
        config = load_serve_config(
            args.config,
            env=os.environ,
            overrides={"host": args.host, "port": args.port, "data_dir": args.data_dir,
                       "model": args.model, "allow_insecure_remote": args.allow_insecure_remote,
                       "device": args.device, "dtype": args.dtype,
                       "http_host": args.http_host, "http_port": args.http_port,
                       "http_enabled": args.http_enabled,
                       "served_model_name": args.served_model_name},
        )
    except ConfigError as exc:
        sys.stderr.write(f"kvgate serve: {exc}\n")
        return EXIT_USAGE
    signals = StopSignals()
    signals.install()

    def announce(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    try:
        serve(config, env=os.environ, stop_requested=signals.stop_requested, announce=announce,
              announces_to_terminal=sys.stdout.isatty(), serving=signals.serving)
    except StartInterrupted as exc:
        sys.stderr.write(f"kvgate serve: stopped before serving ({exc})\n")
        return 0
    except Exception as exc:
        if signals.interruption is not None:  # a library turned the interruption into this
            sys.stderr.write(f"kvgate serve: stopped before serving ({signals.interruption}; "
                             f"the stage it cut short ended with: {exc})\n")
            return 0
        if isinstance(exc, UnservableModel):  # what the gateway cannot serve exactly
            sys.stderr.write(f"kvgate serve: {exc}\n")
            return EXIT_USAGE
        if isinstance(exc, (ConfigError, ServeError, GatewayError)):
            sys.stderr.write(f"kvgate serve: {exc}\n")
            return EXIT_FAILED
        raise
    return 0


def _generate(args: argparse.Namespace, *, out: TextIO, err: TextIO,
              env: Mapping[str, str]) -> int:
    from gateway.client import KvgateClient, KvgateError
    from gateway.core.requests import TokenDelta, Usage

    try:
        messages, tools = read_messages(args.messages)
    except (OSError, ValueError) as exc:
        err.write(f"kvgate generate: --messages {args.messages}: {exc}\n")
        return EXIT_USAGE
    prompt = args.prompt
    if prompt is not None and not args.raw:
        # An instruct model answers a question asked through its chat template; sent raw,
        # SmolLM2 often ends at once.
        messages = [*(messages or []), {"role": "user", "content": prompt}]
        prompt = None
    if messages is None and prompt is None:
        err.write("kvgate generate: give a PROMPT or --messages FILE\n")
        return EXIT_USAGE
    api_key = api_key_of(args.api_key, env, host=args.host, data_dir=args.data_dir)
    root_certificates = args.ca_cert.read_bytes() if args.ca_cert is not None else None
    usage: Usage | None = None
    ends_with_newline = True
    try:
        with KvgateClient(args.host, args.port, api_key, tls=args.tls,
                          root_certificates=root_certificates, timeout_s=args.timeout) as client:
            stream = client.generate(
                prompt, messages=messages, tools=tools, max_tokens=args.max_tokens,
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop, no_cache=args.no_cache,
                priority=args.priority, allow_lossy=args.allow_lossy,
            )
            for item in stream:
                if isinstance(item, TokenDelta):
                    if item.text:
                        out.write(item.text)
                        out.flush()
                        ends_with_newline = item.text.endswith("\n")
                else:
                    usage = item
    except (KvgateError, ValueError) as exc:
        err.write(f"kvgate generate: {exc}\n")
        return EXIT_FAILED
    if out.isatty() and not ends_with_newline:
        out.write("\n")
        out.flush()
    if usage is not None:
        err.write(usage_line(usage) + "\n")
    return 0


def usage_line(usage: Any) -> str:
    """The one-line usage summary ``kvgate generate`` writes to stderr.

    A lossy answer (``Usage.lossy``) ends with ``lossy=yes``; an exact one says nothing more,
    so the line of every exact answer is what it always was. A lossy tier is named with its
    format (``disk:int8:1920``: the count is after the last colon).
    """
    tiers = ",".join(f"{tier}:{n}" for tier, n in sorted(usage.cached_tokens_by_tier.items()))
    line = (f"prompt_tokens={usage.prompt_tokens} cached_tokens={usage.cached_tokens} "
            f"cached_by_tier={tiers or '-'} completion_tokens={usage.completion_tokens} "
            f"ttft_ms={usage.ttft_ms:.1f} total_ms={usage.total_ms:.1f} "
            f"finish={usage.finish_reason}")
    return line + " lossy=yes" if getattr(usage, "lossy", False) else line


if __name__ == "__main__":
    raise SystemExit(main())
