"""``kvgate bench ttft``: cold vs warm time to first token, per tier, beside two references.

For each shared-prefix length (512 / 2,048 / 4,096 tokens by default) plus a unique 32-token
suffix, one run measures, side by side so that the ratios survive a noisy machine:

* kvgate over gRPC: cold (``no_cache``), and warm with the prefix served from each tier --
  device (just warmed), host, disk and Redis. A tier is forced with the Admin API: *host* by
  warming a filler prompt as large as the device tier (its promotion demotes the prefix to
  host: the only way blocks reach host is demotion), *disk* by evicting the host and device
  copies, *Redis* by evicting every local copy (device, host, disk) so that the gateway has to
  fetch the chain another replica would have left there. The tier that served a request is
  read from its usage (``cached_tokens_by_tier``), never assumed.
* transformers' prompt-reuse recipe, in this process on the same model: prefill the prefix
  into a ``DynamicCache`` once, then per request ``copy.deepcopy`` it and run the suffix.
* llama.cpp's own prompt cache on the same GGUF file (``LlamaRAMCache`` and ``LlamaDiskCache``
  through llama-cpp-python, 2 threads), run by the separate ``.venv-peers`` interpreter
  (``make bench-peers``) so that kvgate's own environment needs nothing; absent, the rows
  say so.

Each figure is the median of ``--repeats`` requests. TTFT is what a client sees: from the call
to the first streamed item, over gRPC on loopback (the gateway's own ``usage.ttft_ms`` is shown
beside it); the references are timed in process. Prompts are real English prose tokenised with
the model's tokenizer and cut to exact token counts, sent as ``token_ids``.

``--spawn`` starts its own ``kvgate serve`` (and a ``redis-server``, if one is on PATH) on free
loopback ports with a temporary data directory, configured for the benchmark (its own tenant
and admin keys, a device tier the size of the longest prefix), and stops them by pid at the end.
``--device`` and ``--dtype`` (``auto`` by default, as for ``kvgate serve``) put the transformers
reference and a spawned gateway on the same device in the same dtype (``gateway.bench.numerics``).

Here: the gateway's rows, the run and the report. The references are ``gateway.bench.peers``,
the spawned gateway ``gateway.bench.spawn``, the prompts ``gateway.bench.prompts``, the records
``gateway.bench.rows``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from gateway.bench.numerics import BenchNumerics, resolve_numerics
from gateway.bench.peers import LLAMA_CPP_THREADS, hf_recipe_rows, llama_cpp_rows, peers_python
from gateway.bench.plotting import plot_ttft
from gateway.bench.prompts import SuffixSource, make_prefix
from gateway.bench.rows import (
    COLD,
    COLD_OF,
    DEVICE,
    DISK,
    HOST,
    LLAMA_COLD,
    LLAMA_DISK,
    LLAMA_RAM,
    REDIS,
    BenchError,
    LengthResult,
    Row,
    Sample,
)
from gateway.bench.spawn import Endpoint, EngineOptions, spawn_gateway
from gateway.bench.ttft_targets import print_targets
from gateway.client import KvgateClient, StatsReport
from gateway.core.requests import TokenDelta, Usage
from gateway.engine.models.loading import LoadedModel, ModelLoadError, load_model, resolve_source
from tiers.kinds.host import HOST as HOST_TIER

DEFAULT_LENGTHS = (512, 2048, 4096)


# ---- the gateway ----------------------------------------------------------------------------



def _served_from(usage: Usage) -> str:
    if not usage.cached_tokens_by_tier:
        return "-"
    return "+".join(f"{tier}:{n}" for tier, n in sorted(usage.cached_tokens_by_tier.items()))


def time_generate(client: KvgateClient, token_ids: Sequence[int], *,
                  no_cache: bool = False) -> Sample:
    """One generation of a single token; TTFT from the call to the first streamed item."""
    began = time.perf_counter()
    first: float | None = None
    usage: Usage | None = None
    for item in client.generate(token_ids=token_ids, max_tokens=1, no_cache=no_cache):
        if first is None:
            first = time.perf_counter() - began
        if not isinstance(item, TokenDelta):
            usage = item
    if first is None or usage is None:
        raise BenchError("the gateway's stream ended without a usage message")
    return Sample(seconds=first, cached_tokens=usage.cached_tokens,
                  served_from=_served_from(usage), server_ms=usage.ttft_ms)


class GatewayBench:
    """The kvgate rows of one length, through a tenant client and (for tiers) an admin one."""

    def __init__(self, endpoint: Endpoint, *, block_tokens: int, block_bytes: int,
                 max_prompt_tokens: int, timeout_s: float, err: TextIO) -> None:
        self._endpoint = endpoint
        self._block_tokens = block_tokens
        self._block_bytes = block_bytes
        self._max_prompt_tokens = max_prompt_tokens
        self._timeout_s = timeout_s
        self._err = err
        self._client: KvgateClient | None = None
        self._admin: KvgateClient | None = None
        self._filler: list[int] | None = None

    def __enter__(self) -> GatewayBench:
        e = self._endpoint
        self._client = KvgateClient(e.host, e.port, e.api_key, timeout_s=self._timeout_s)
        if e.admin_key is not None:
            self._admin = KvgateClient(e.host, e.port, e.admin_key, timeout_s=self._timeout_s)
        return self

    def __exit__(self, *exc: object) -> None:
        for client in (self._client, self._admin):
            if client is not None:
                client.close()

    @property
    def client(self) -> KvgateClient:
        assert self._client is not None, "use GatewayBench as a context manager"
        return self._client

    def engine_numerics(self) -> tuple[str, str] | None:
        """The (device, dtype) the gateway's engine runs on, from Stats (None: no admin key,
        or a gateway too old to say)."""
        stats = self._stats()
        if stats is None or stats.engine is None or not stats.engine.device:
            return None
        return stats.engine.device, stats.engine.dtype

    def warm_up(self, token_ids: Sequence[int]) -> None:
        """One uncached request, so that one-off costs of a fresh server are not timed."""
        time_generate(self.client, token_ids, no_cache=True)

    def measure(self, loaded: LoadedModel, prefix: list[int], suffixes: SuffixSource,
                repeats: int, *, filler_tag: str) -> list[Row]:
        n = len(prefix)
        rows = [Row(label=COLD, system="kvgate")]
        for i in range(repeats):
            rows[0].samples.append(time_generate(self.client, prefix + suffixes.next(),
                                                 no_cache=True))
            self._progress(f"{n}: kvgate cold {i + 1}/{repeats}", rows[0].samples[-1])
        stats = self._stats()
        result = self.client.warm(token_ids=prefix)
        self._settle(stats, num_new_blocks=result.num_new_blocks)
        device = Row(label=DEVICE, system="kvgate", tier="device")
        rows.append(device)
        for i in range(repeats):
            device.samples.append(time_generate(self.client, prefix + suffixes.next()))
            self._progress(f"{n}: kvgate warm device {i + 1}/{repeats}", device.samples[-1])
        rows.append(self._host_row(loaded, prefix, suffixes, repeats, filler_tag))
        rows.append(self._disk_row(prefix, suffixes, repeats))
        rows.append(self._redis_row(prefix, suffixes, repeats, stats, result.num_new_blocks))
        return rows

    # -- forcing a tier ------------------------------------------------------------------

    def _tier_names(self) -> list[str]:
        stats = self._stats()
        return [t.name for t in stats.tiers] if stats is not None else []

    def _host_row(self, loaded: LoadedModel, prefix: list[int], suffixes: SuffixSource,
                  repeats: int, filler_tag: str) -> Row:
        row = Row(label=HOST, system="kvgate", tier=HOST_TIER)
        if self._admin is None:
            row.note = "n/a (needs --admin-key, or --spawn)"
            return row
        stats = self._stats()
        assert stats is not None
        budgets = {t.name: t.budget_bytes for t in stats.tiers}
        if HOST_TIER not in budgets:
            row.note = "n/a (this gateway has no host tier)"
            return row
        num_blocks = -(-budgets["device"] // self._block_bytes)
        filler_tokens = num_blocks * self._block_tokens
        if filler_tokens > self._max_prompt_tokens:
            # Demotion is the only way into host and a filler this big cannot be sent: evicting
            # the device copy serves the next tier down (disk, usually), as its usage says.
            for i in range(repeats):
                self._force(prefix, evict=("device",))
                row.samples.append(time_generate(self.client, prefix + suffixes.next()))
                self._progress(f"{len(prefix)}: kvgate warm host (device evicted) "
                               f"{i + 1}/{repeats}", row.samples[-1])
            return row
        if self._filler is None or len(self._filler) != filler_tokens:
            self._filler = make_prefix(loaded, filler_tokens, filler_tag)
        for i in range(repeats):
            # The filler fills the device tier: promoting it demotes the prefix to host.
            before = self._stats()
            warmed = self.client.warm(token_ids=self._filler)
            self._settle(before, num_new_blocks=warmed.num_new_blocks)
            self._check_tiers(prefix, HOST_TIER)
            row.samples.append(time_generate(self.client, prefix + suffixes.next()))
            self._progress(f"{len(prefix)}: kvgate warm host {i + 1}/{repeats}", row.samples[-1])
        return row

    def _disk_row(self, prefix: list[int], suffixes: SuffixSource, repeats: int) -> Row:
        row = Row(label=DISK, system="kvgate", tier="disk")
        if self._admin is None:
            row.note = "n/a (needs --admin-key, or --spawn)"
            return row
        tiers = self._tier_names()
        if "disk" not in tiers:
            row.note = "n/a (this gateway has no disk tier)"
            return row
        for i in range(repeats):
            self._force(prefix, evict=tuple(t for t in (HOST_TIER, "device") if t in tiers))
            row.samples.append(time_generate(self.client, prefix + suffixes.next()))
            self._progress(f"{len(prefix)}: kvgate warm disk {i + 1}/{repeats}", row.samples[-1])
        return row

    def _redis_row(self, prefix: list[int], suffixes: SuffixSource, repeats: int,
                   before_warm: StatsReport | None, num_new_blocks: int) -> Row:
        row = Row(label=REDIS, system="kvgate", tier="redis")
        if self._endpoint.why_no_redis is not None:
            row.note = f"n/a ({self._endpoint.why_no_redis})"
            return row
        if self._admin is None:
            row.note = "n/a (needs --admin-key, or --spawn)"
            return row
        stats = self._stats()
        assert stats is not None
        if not any(s.name == "redis" for s in stats.stores):
            row.note = "n/a (this gateway has no Redis tier)"
            return row
        self._settle(before_warm, num_new_blocks=num_new_blocks)  # the chain is in Redis
        tiers = [t.name for t in stats.tiers]
        local = tuple(t for t in ("device", HOST_TIER, "disk") if t in tiers)
        for i in range(repeats):
            # No local copy left: the chain comes from Redis, as on a replica that never saw it.
            self._force(prefix, evict=local)
            row.samples.append(time_generate(self.client, prefix + suffixes.next()))
            self._progress(f"{len(prefix)}: kvgate warm redis {i + 1}/{repeats}",
                           row.samples[-1])
        return row

    def _force(self, prefix: list[int], *, evict: Sequence[str],
               timeout_s: float = 30.0) -> None:
        """Evict the prefix's copies in ``evict`` and check with Lookup that they are gone.

        The engine stores a response's blocks after sending it, holding them meanwhile, and an
        Admin eviction leaves held blocks alone: a Warm of a single token (nothing to compute,
        queued behind that work on the engine's one worker) waits for it to end first.
        """
        assert self._admin is not None
        self.client.warm(token_ids=prefix[:1])
        deadline = time.monotonic() + timeout_s
        while True:
            for tier in evict:
                self._admin.evict(tenant=self._endpoint.tenant, tier=tier)
            left = set(self.client.lookup(token_ids=prefix).cached_tokens_by_tier) & set(evict)
            if not left:
                return
            if time.monotonic() > deadline:
                self._err.write(f"[ttft] warning: the prefix is still in {sorted(left)} after "
                                f"{timeout_s:.0f} s of evictions\n")
                return
            time.sleep(0.05)

    def _check_tiers(self, prefix: list[int], tier: str) -> None:
        where = self.client.lookup(token_ids=prefix).cached_tokens_by_tier
        if set(where) != {tier}:
            self._err.write(f"[ttft] warning: Lookup says the prefix is in {where}, not only "
                            f"{tier}\n")

    def _stats(self) -> StatsReport | None:
        return self._admin.stats() if self._admin is not None else None

    def _settle(self, before: StatsReport | None, *, num_new_blocks: int,
                timeout_s: float = 60.0) -> None:
        """Wait until queued disk writes are done and a warm's new blocks reached Redis."""
        if self._admin is None or before is None:
            return
        want = _redis_writes(before) + num_new_blocks
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = self._admin.stats()
            disk_busy = any(s.name == "disk" and s.notes.get("queued_writes", "0") != "0"
                            for s in now.stores)
            has_redis = any(s.name == "redis" for s in now.stores)
            if not disk_busy and (not has_redis or _redis_writes(now) >= want):
                return
            time.sleep(0.05)
        self._err.write("[ttft] warning: writes to disk/Redis still queued after "
                        f"{timeout_s:.0f} s\n")

    def _progress(self, what: str, sample: Sample) -> None:
        self._err.write(f"[ttft] {what}: {sample.seconds * 1e3:.1f} ms "
                        f"(cached {sample.cached_tokens}, {sample.served_from})\n")
        self._err.flush()


def _redis_writes(stats: StatsReport) -> int:
    """Blocks the Redis store has written, found already there, or dropped."""
    for store in stats.stores:
        if store.name == "redis":
            notes = store.notes
            return store.puts + int(float(notes.get("num_put_existing", "0"))) + int(
                float(notes.get("num_dropped_puts", "0")))
    return 0



# ---- the report ------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def print_table(result: LengthResult, *, suffix_tokens: int, repeats: int, out: TextIO) -> None:
    out.write(f"\nprefix {result.prefix_tokens:,} tokens + {suffix_tokens}-token suffix "
              f"(median of {repeats})\n")
    header = (f"{'row':<36} {'TTFT ms':>10} {'x cold':>7} {'server ms':>10} {'cached':>7}  "
              "served from\n")
    out.write(header)
    out.write("-" * (len(header) + 8) + "\n")
    for row in result.rows:
        if row.note is not None:
            out.write(f"{row.label:<36} {row.note}\n")
            continue
        cold = result.row(COLD_OF[row.system])
        median = row.median_s
        cold_s = cold.median_s if cold is not None else None
        ratio = f"{median / cold_s:.3f}" if median is not None and cold_s else "-"
        server = row.server_median_ms
        out.write(
            f"{row.label:<36} {_ms(median):>10} {ratio:>7} "
            f"{'-' if server is None else f'{server:,.1f}':>10} {row.cached_text:>7}  "
            f"{row.served_text}\n"
        )


# ---- the run -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TtftOptions:
    """What ``kvgate bench ttft`` measures and against which gateway (see ``--help``)."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    suffix_tokens: int = 32
    repeats: int = 3
    block_tokens: int = 64
    model: str = "bundled"
    data_dir: Path = Path("data")
    spawn: bool = False
    host: str = "127.0.0.1"
    port: int = 50051
    api_key: str | None = None
    admin_key: str | None = None
    tenant: str = "default"
    redis_url: str | None = None
    redis_binary: str | None = None
    peers_python: Path | None = None
    with_peers: bool = True
    timeout_s: float = 600.0
    plot: Path | None = None
    """Where to draw the PNG of the tables (None: no PNG)."""
    numerics: BenchNumerics = field(default_factory=resolve_numerics)
    """Where the in-process references and a spawned gateway run, and in what dtype."""
    skip_slow_tiers: bool = False
    """The spawned gateway's ``[cache] skip_slow_tiers``: False (the bench's default) makes
    every tier row load from its tier; True is what users get by default."""
    captured_steps: bool = True
    """The spawned gateway's ``[engine] captured_steps`` (CUDA graphs on CUDA; docs/gpu.md)."""


def run_ttft_benchmark(options: TtftOptions, *, out: TextIO, err: TextIO) -> list[LengthResult]:
    """Measure every row of every length, print one table per length and the targets.

    Raises:
        BenchError: a process did not start, or a length does not fit the model.
        gateway.client.KvgateError: a call to the gateway failed.
        gateway.engine.models.loading.ModelLoadError: the model cannot be loaded.
    """
    if options.repeats < 1 or not options.lengths or options.suffix_tokens < 1:
        raise BenchError("--repeats, --lengths and --suffix-tokens must be positive")
    bt = options.block_tokens
    busy_before = cpu_busy_fraction()
    if busy_before is not None and busy_before > 0.25:
        err.write(f"[ttft] warning: the CPU is {busy_before:.0%} busy before starting: other "
                  "processes are using it, and every figure will be noisy\n")
    numerics = options.numerics
    err.write(f"[ttft] loading {options.model} in this process (HF recipe, tokenizer) "
              f"{numerics.describe()} ...\n")
    loaded = load_model(options.model, cache_dir=options.data_dir / "models",
                        device=numerics.device, dtype=numerics.dtype, block_tokens=bt)
    for n in options.lengths:
        if n % bt:
            err.write(f"[ttft] warning: {n} is not a multiple of the block size {bt}: its last "
                      "partial block is recomputed by every warm request\n")
        if n + options.suffix_tokens + 1 > loaded.max_context:
            raise BenchError(f"a {n}-token prefix + {options.suffix_tokens}-token suffix does "
                             f"not fit the model's context of {loaded.max_context} tokens")
    block_bytes = loaded.layout.block_nbytes(bt)
    longest_blocks = -(-max(options.lengths) // bt)
    # Room for exactly the longest prefix: a filler prompt as long fills the device tier, so
    # warming it demotes every other block to host.
    device_bytes = longest_blocks * block_bytes
    nonce = secrets.token_hex(4)
    prefixes = {n: make_prefix(loaded, n, f"{n} tokens {nonce}") for n in options.lengths}
    suffixes = {n: SuffixSource(loaded, options.suffix_tokens) for n in options.lengths}
    results = [LengthResult(prefix_tokens=n) for n in options.lengths]

    with _endpoint(options, device_bytes, err) as endpoint, GatewayBench(
        endpoint, block_tokens=bt, block_bytes=block_bytes,
        max_prompt_tokens=loaded.max_context - 1, timeout_s=options.timeout_s, err=err,
    ) as bench:
        bench.warm_up(make_prefix(loaded, min(64, bt), f"Warm-up {nonce}"))
        served_on = bench.engine_numerics()
        if served_on is not None and served_on != (numerics.device_text, numerics.dtype_name):
            err.write(f"[ttft] warning: the gateway runs on {served_on[0]} in {served_on[1]}, "
                      f"the transformers reference {numerics.describe()}: their rows compare "
                      "different hardware (give the bench the gateway's --device and --dtype)\n")
        for result in results:
            n = result.prefix_tokens
            result.rows += bench.measure(loaded, prefixes[n], suffixes[n], options.repeats,
                                         filler_tag=f"Filler {nonce}")
            result.rows += hf_recipe_rows(loaded, prefixes[n], suffixes[n], options.repeats, err,
                                          numerics)

    peers_note = "n/a (--no-peers)"
    version = ""
    python: Path | None = None
    if options.with_peers:
        python, peers_note = peers_python(options.peers_python)
    gguf = _gguf_of(options.model)
    if python is not None and gguf is None:
        peers_note = "n/a (llama.cpp needs a GGUF model: --model bundled or a .gguf file)"
        python = None
    if python is not None and gguf is not None:
        err.write(f"[ttft] llama.cpp reference ({python}) on {gguf.name} ...\n")
        by_length, version = llama_cpp_rows(
            python, gguf, [(prefixes[r.prefix_tokens], suffixes[r.prefix_tokens])
                           for r in results], options.repeats, err)
        for result in results:
            result.rows += by_length[result.prefix_tokens]
    else:
        for result in results:
            result.rows += [Row(label=label, system="llama.cpp", note=peers_note)
                            for label in (LLAMA_COLD, LLAMA_RAM, LLAMA_DISK)]

    _print_report(options, loaded, results, endpoint, served_on, version,
                  (busy_before, cpu_busy_fraction()), out)
    if options.plot is not None:
        plot_ttft(results, options.plot, out)
    return results


def cpu_busy_fraction(interval_s: float = 0.5) -> float | None:
    """How busy all CPUs are over ``interval_s`` (Linux ``/proc/stat``; None elsewhere): what
    else runs on the machine while the benchmark is idle."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = [int(v) for v in fh.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    elapsed = total1 - total0
    return 1.0 - (idle1 - idle0) / elapsed if elapsed > 0 else None


@contextmanager
def _endpoint(options: TtftOptions, device_bytes: int, err: TextIO) -> Iterator[Endpoint]:
    if not options.spawn:
        yield Endpoint(host=options.host, port=options.port, api_key=options.api_key,
                       admin_key=options.admin_key, tenant=options.tenant)
        return
    binary = options.redis_binary or shutil.which("redis-server")
    with spawn_gateway(model=options.model, models_dir=options.data_dir / "models",
                       block_tokens=options.block_tokens, device_bytes=device_bytes,
                       redis_url=options.redis_url, redis_binary=binary, err=err,
                       device=options.numerics.device_text, dtype=options.numerics.dtype_name,
                       skip_slow_tiers=options.skip_slow_tiers,
                       engine=EngineOptions(
                           captured_steps=None if options.captured_steps else False)
                       ) as endpoint:
        yield endpoint


def _gguf_of(model: str) -> Path | None:
    try:
        source = resolve_source(model)
    except ModelLoadError:
        return None
    return source.directory / source.gguf_file if source.gguf_file is not None else None


def _print_report(options: TtftOptions, loaded: LoadedModel, results: Sequence[LengthResult],
                  endpoint: Endpoint, served_on: tuple[str, str] | None, llama_version: str,
                  busy: tuple[float | None, float | None], out: TextIO) -> None:
    where = ("spawned gateway" if options.spawn
             else f"gateway at {endpoint.host}:{endpoint.port}") + (
        f" on {served_on[0]} in {served_on[1]}" if served_on is not None
        else " (device and dtype unknown: no admin key)")
    out.write(
        f"kvgate bench ttft: model {loaded.name} ({loaded.layout.num_layers} layers, "
        f"{loaded.layout.kv_heads} KV heads x {loaded.layout.head_dim}) "
        f"{options.numerics.describe()}, {where}, blocks of {options.block_tokens} tokens; "
        f"{os.cpu_count()} CPU cores, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads"
        + (f"; llama-cpp-python {llama_version} with {LLAMA_CPP_THREADS} threads"
           if llama_version else "")
        + "; CPU busy with other work: "
        + ", ".join(f"{'?' if b is None else f'{b:.0%}'} {when}"
                    for b, when in zip(busy, ("before", "after"), strict=True))
        + "\n"
    )
    for result in results:
        print_table(result, suffix_tokens=options.suffix_tokens, repeats=options.repeats,
                    out=out)
    print_targets(results, out, on_gpu=options.numerics.device.type == "cuda")
    out.write(
        "\nTTFT ms: kvgate rows from the client's call to the first streamed item (gRPC on "
        "loopback), the references in process; server ms: the gateway's own usage.ttft_ms. "
        "x cold: against the same system's cold row. served from: what each response's usage "
        "said (cached_tokens_by_tier). Host is forced by a filler prompt that fills the device "
        "tier, disk by evicting host+device, Redis by evicting every local tier; disk reads "
        "likely come from the page cache.\n"
    )
    if options.spawn:
        out.write("The spawned gateway " + (
            "runs every step eagerly (captured_steps = false) and " * (not options.captured_steps)
        ) + (
            "skips a tier measured slower than recomputing (skip_slow_tiers = true, the "
            "default): a tier row is what a user gets.\n" if options.skip_slow_tiers else
            "loads from every tier (skip_slow_tiers = false): a tier row is that tier's load; "
            "by default a gateway recomputes where a tier is measured slower (--skip-slow-tiers "
            "shows that).\n"))
