"""``kvgate bench metrics``: how fast ``GET /metrics`` answers while users chat (issue 26, item 3).

A router polls the API port's ``/metrics`` while the server is busy (the Gateway API Inference
Extension's endpoint picker: every 50 ms), and an operator's ``curl :8000/metrics`` should come
back at once (target: 5 ms). This benchmark spawns one ``kvgate serve`` (as ``kvgate bench load``
does: free loopback ports, a temporary data directory, stopped by pid), then, from a scraper
thread of this process, every ``--interval-ms``:

* ``keep-alive``: ``GET /metrics`` on one kept-alive connection (a router, Prometheus);
* ``new``: the same on a new connection, connect to last byte, half an interval later -- so
  that neither is served the other's body (the front renders at most once per 20 ms,
  ``gateway.service.http.metrics_page``): every scrape measured is a render;
* ``curl``: where ``curl`` is on PATH, every other round's new-connection scrape is ``curl``'s
  own (``-w %{time_total}``: connect to last byte, timed inside curl, without this process's
  Python client around it) -- the target is worded as ``curl :8000/metrics``;

first for ``--idle-s`` seconds with nothing else running, then while ``--users`` users chat
``--rounds`` rounds each over gRPC under one shared system prompt (``kvgate bench load``'s
workload, ``gateway.bench.chat_workload``). Each scrape is timed from the request's first byte
to the body's last; every answer must be 200 and parse as Prometheus text with the
``vllm:num_requests_running`` series in it. The table gives p50/p99/max per phase and
connection, the body size, and the load's own figures (requests, TTFT p50/p99) so that the
load can be compared with ``kvgate bench load`` at the same users.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gateway.bench.chat_workload import DEFAULT_RULES, system_prompt
from gateway.bench.load import percentile
from gateway.bench.load_clients import ChatSession, KvgateSession, run_users
from gateway.bench.numerics import BenchNumerics, resolve_numerics
from gateway.bench.peer_serve import StreamedReply
from gateway.bench.rows import BenchError
from gateway.bench.spawn import EngineOptions, spawn_gateway
from gateway.engine.models.loading import resolve_source
from gateway.engine.parity.verdicts import cpu_identity

ROUTER_SERIES = b"vllm:num_requests_running"
"""A series every scrape must carry (what a router reads first)."""
KEEP_ALIVE = "keep-alive"
NEW_CONNECTION = "new"
CURL = "curl"
HEALTH = "health"
"""``GET /health`` on the kept-alive connection right after its scrape: the front's own floor
(an answer with no render), under the same load."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsBenchOptions:
    """What ``kvgate bench metrics`` measures (see ``--help``)."""

    users: int = 8
    rounds: int = 4
    max_tokens: int = 32
    num_rules: int = DEFAULT_RULES
    interval_s: float = 0.05
    idle_s: float = 3.0
    block_tokens: int = 64
    model: str = "bundled"
    data_dir: Path = Path("data")
    timeout_s: float = 600.0
    numerics: BenchNumerics = field(default_factory=resolve_numerics)


@dataclass(slots=True)
class ScrapeTimes:
    """The seconds each scrape took, by connection kind, and the last body's size."""

    seconds: dict[str, list[float]] = field(
        default_factory=lambda: {KEEP_ALIVE: [], NEW_CONNECTION: [], CURL: [], HEALTH: []})
    num_bytes: int = 0


class Scraper:
    """``GET /metrics`` every ``interval_s`` on a thread of its own, both ways, until stopped.

    Args:
        host, port: the HTTP API's address.
        interval_s: from the start of one round of scrapes to the next (a late round starts the
            next one at once, never two at a time).
        timeout_s: the socket timeout of each scrape.
        curl: a ``curl`` binary: every other round's new-connection scrape is its (None: all
            are this process's).
    """

    def __init__(self, host: str, port: int, *, interval_s: float,
                 timeout_s: float = 10.0, curl: str | None = None) -> None:
        self._host, self._port = host, port
        self._curl = curl
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._times = ScrapeTimes()
        self._failure: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)
        self._thread.start()

    def stop(self) -> ScrapeTimes:
        """Stop and return what was measured.

        Raises:
            BenchError: a scrape failed (not 200, no router series, a socket error).
        """
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            raise BenchError(f"a scrape of /metrics failed: {self._failure}") from self._failure
        return self._times

    def _run(self) -> None:
        kept = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        try:
            next_at = time.perf_counter()
            round_index = 0
            while not self._stop.is_set():
                self._scrape(KEEP_ALIVE, kept)
                self._health(kept)
                if self._stop.wait(max(0.0, next_at + self._interval_s / 2
                                       - time.perf_counter())):
                    break
                round_index += 1
                if self._curl is not None and round_index % 2 == 0:
                    self._scrape_with_curl(self._curl)
                else:
                    fresh = http.client.HTTPConnection(self._host, self._port,
                                                       timeout=self._timeout_s)
                    try:
                        self._scrape(NEW_CONNECTION, fresh)
                    finally:
                        fresh.close()
                # a late round starts the next at once, and never catches up with a burst
                next_at = max(next_at + self._interval_s, time.perf_counter())
                self._stop.wait(max(0.0, next_at - time.perf_counter()))
        except (OSError, http.client.HTTPException, BenchError) as exc:
            self._failure = exc
        finally:
            kept.close()

    def _health(self, connection: http.client.HTTPConnection) -> None:
        began = time.perf_counter()
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        elapsed = time.perf_counter() - began
        if response.status != 200:
            raise BenchError(f"GET /health answered {response.status}")
        self._times.seconds[HEALTH].append(elapsed)

    def _scrape_with_curl(self, curl: str) -> None:
        """``curl -s URL``, timed by curl itself (connect to last byte)."""
        done = subprocess.run(
            [curl, "-s", "--max-time", f"{self._timeout_s:g}", "-w", "\n%{http_code} %{time_total}",
             f"http://{self._host}:{self._port}/metrics"],
            capture_output=True, timeout=self._timeout_s + 5, check=False)
        body, _, trailer = done.stdout.rpartition(b"\n")
        status, _, seconds = trailer.decode(errors="replace").partition(" ")
        if done.returncode != 0 or status != "200" or ROUTER_SERIES not in body:
            raise BenchError(f"curl /metrics answered {status or 'nothing'} (exit "
                             f"{done.returncode}, {len(body)} bytes)")
        self._times.seconds[CURL].append(float(seconds))

    def _scrape(self, kind: str, connection: http.client.HTTPConnection) -> None:
        began = time.perf_counter()
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - began
        if response.status != 200 or ROUTER_SERIES not in body:
            raise BenchError(f"GET /metrics answered {response.status} "
                             f"({len(body)} bytes, router series "
                             f"{'present' if ROUTER_SERIES in body else 'missing'})")
        self._times.seconds[kind].append(elapsed)
        self._times.num_bytes = len(body)


@dataclass(slots=True, kw_only=True)
class MetricsBenchResult:
    """The scrapes of both phases, and the load's replies."""

    idle: ScrapeTimes
    loaded: ScrapeTimes
    replies: list[StreamedReply]
    wall_s: float
    route: str


def run_metrics_benchmark(options: MetricsBenchOptions, *, out: TextIO,
                          err: TextIO) -> MetricsBenchResult:
    """Spawn a gateway, scrape it idle and under the chat load; print the table.

    Raises:
        BenchError: the server did not start, a request or a scrape failed.
        gateway.engine.models.loading.ModelLoadError: the model cannot be found or converted.
    """
    if options.users < 1 or options.rounds < 1 or options.max_tokens < 1 \
            or options.interval_s <= 0 or options.idle_s < 0:
        raise BenchError("--users, --rounds, --max-tokens and --interval-ms must be positive")
    resolve_source(options.model)  # fail early, before the server starts
    system = system_prompt(options.num_rules)
    n = options.users
    engine = EngineOptions(max_running=max(16, n), max_running_per_tenant=max(8, n),
                           max_queued_per_tenant=max(32, n))
    with spawn_gateway(model=options.model, models_dir=options.data_dir / "models",
                       block_tokens=options.block_tokens, device_bytes=2 << 30, redis_url=None,
                       redis_binary=None, err=err, engine=engine, label="metrics",
                       device=options.numerics.device_text,
                       dtype=options.numerics.dtype_name) as endpoint:
        if endpoint.http_port is None:
            raise BenchError("the spawned kvgate serve named no HTTP port in its start line")

        def session() -> ChatSession:
            return KvgateSession(endpoint.host, endpoint.port, endpoint.api_key,
                                 max_tokens=options.max_tokens, no_cache=False,
                                 timeout_s=options.timeout_s)

        _warm_up(session)
        idle = _scraping(endpoint.host, endpoint.http_port, options.interval_s,
                         lambda: time.sleep(options.idle_s))
        err.write(f"[metrics] idle: {len(idle.seconds[KEEP_ALIVE])} scrapes of each kind\n")
        load: list[tuple[list[StreamedReply], float]] = []
        loaded = _scraping(endpoint.host, endpoint.http_port, options.interval_s,
                           lambda: load.append(run_users(
                               session, num_users=n, rounds=options.rounds, system=system,
                               num_rules=options.num_rules)))
        replies, wall = load[0]
        err.write(f"[metrics] under load: {len(replies)} requests in {wall:.1f} s, "
                  f"{len(loaded.seconds[KEEP_ALIVE])} scrapes of each kind\n")
    result = MetricsBenchResult(idle=idle, loaded=loaded, replies=replies, wall_s=wall,
                                route=(endpoint.route or "?").split(" ", 1)[0])
    print_table(options, result, out)
    return result


def _scraping(host: str, port: int, interval_s: float, work: Callable[[], None]) -> ScrapeTimes:
    """Scrape every ``interval_s`` while ``work()`` runs."""
    scraper = Scraper(host, port, interval_s=interval_s, curl=shutil.which("curl"))
    scraper.start()
    try:
        work()
    finally:
        times = scraper.stop()
    return times


def _warm_up(session: Callable[[], ChatSession]) -> None:
    """One short request, untimed: a fresh server's one-off costs are not the load's."""
    warm = session()
    try:
        warm.chat([{"role": "user", "content": "Say hello."}])
    finally:
        warm.close()


def print_table(options: MetricsBenchOptions, result: MetricsBenchResult, out: TextIO) -> None:
    out.write(
        f"kvgate bench metrics: GET /metrics every {options.interval_s * 1e3:.0f} ms on the "
        f"HTTP API port, idle for {options.idle_s:g} s, then while {options.users} users chat "
        f"({options.rounds} rounds x {options.max_tokens} tokens, {options.num_rules}-rule "
        f"system prompt, gRPC); model {options.model} {options.numerics.describe()}, engine "
        f"route {result.route}; {cpu_identity().split(' [', 1)[0]}, {os.cpu_count()} CPU "
        f"cores\n\n")
    header = (f"{'phase':<11} {'connection':<10} {'scrapes':>7} {'p50 ms':>7} {'p99 ms':>7} "
              f"{'max ms':>7}  body\n")
    out.write(header)
    out.write("-" * len(header) + "\n")
    for phase, times in (("idle", result.idle), ("under load", result.loaded)):
        for kind in (KEEP_ALIVE, NEW_CONNECTION, CURL, HEALTH):
            seconds = times.seconds[kind]
            if not seconds:
                out.write(f"{phase:<11} {kind:<10} {0:>7}"
                          + ("  (no curl on PATH)" if kind == CURL else "") + "\n")
                continue
            out.write(f"{phase:<11} {kind:<10} {len(seconds):>7} "
                      f"{percentile(seconds, 0.5) * 1e3:>7.2f} "
                      f"{percentile(seconds, 0.99) * 1e3:>7.2f} {max(seconds) * 1e3:>7.2f}  "
                      + (f"{times.num_bytes / 1024:.1f} KiB" if kind != HEALTH
                         else "(/health, kept-alive)") + "\n")
    ttft = [r.ttft_s for r in result.replies]
    out.write(
        f"\nthe load: {len(result.replies)} requests in {result.wall_s:.1f} s, TTFT p50 "
        f"{percentile(ttft, 0.5) * 1e3:,.0f} ms, p99 {percentile(ttft, 0.99) * 1e3:,.0f} ms "
        "(client side, gRPC). A scrape is timed from its request's first byte to its body's "
        "last; 'new' includes the TCP connect; 'curl' is curl's own time_total on a new "
        "connection, in every other round instead of 'new'; 'health' is GET /health on the "
        "kept-alive connection right after its scrape: the front's answer without a render.\n")
