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
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from gateway.client import KvgateClient, StatsReport
from gateway.core.requests import TokenDelta, Usage
from gateway.engine.model import LoadedModel, ModelLoadError, load_model, resolve_source

DEFAULT_LENGTHS = (512, 2048, 4096)
TARGET_LENGTH = 2048
PEERS_VENV = ".venv-peers"
LLAMA_CPP_THREADS = 2
SPAWN_TENANT = "bench"

_SERVING = re.compile(r"SERVING kvgate\.v1 on 127\.0\.0\.1:(\d+)")

PROSE = (
    "The lighthouse keeper kept a ledger of every ship that passed the headland, noting the "
    "hour, the wind and the colour of the sea. Over forty winters the pages filled with small, "
    "careful handwriting, and a reader who turned them today would find not only the traffic "
    "of a busy coast but the slow story of a man who learned to read weather the way others "
    "read faces.",
    "A river does not carve a valley in a day. Each flood moves a little gravel, each dry "
    "summer lets the banks settle, and the shape we see is the sum of countless ordinary "
    "seasons. Geologists like to say that the present is the key to the past, because the "
    "same quiet forces are still at work under our feet.",
    "When the library reopened after the repairs, the librarians found that readers had "
    "changed their habits. Fewer people came to borrow novels, more came to sit in the warm "
    "reading room with a laptop, and the children's corner was busier than ever on rainy "
    "afternoons. The building was the same; what people needed from it was not.",
    "Bread is a conversation between flour, water, salt and time. A baker who hurries the "
    "dough gets a loaf that looks right and tastes of little, while one who lets it rest "
    "overnight in a cool room is rewarded with a crust that crackles and a crumb full of "
    "irregular holes. Patience, more than any recipe, is the secret ingredient.",
    "The first railway timetables were printed because towns kept their own local time, set "
    "by the sun, and a train that left one station at noon could arrive at the next before it "
    "had departed. Standard time zones were a practical answer to a practical problem, and "
    "they quietly changed how everyone thought about the hours of the day.",
    "In the high meadows the snow lingers until June, and the flowers have only a few weeks "
    "to bloom, be pollinated and set seed before the cold returns. Botanists who study them "
    "describe a race against the calendar in which every warm afternoon matters and a single "
    "late frost can undo a whole year of growth.",
    "A good map leaves things out. The mapmaker decides which roads, rivers and villages a "
    "traveller needs, and draws them clearly, while the thousand details that would only "
    "clutter the page are quietly dropped. The art lies in knowing what the reader is trying "
    "to do and serving that purpose without distraction.",
    "Old sailing ships carried spare canvas, rope and timber, because a storm far from any "
    "harbour could tear a sail or crack a spar, and the crew had to mend what broke with what "
    "they had on board. Seamanship was as much about careful preparation before a voyage as "
    "about courage during it.",
)
"""Paragraphs of plain English prose: the shared prefix is made of these, repeated."""

_SUFFIX_LEADS = (
    "Why", "How", "What", "When", "Where", "Which", "Who", "Explain", "Describe", "Summarise",
    "List", "Compare", "Consider", "Imagine", "Suppose", "Tell", "Give", "Name", "Recall",
    "Discuss", "Outline", "State", "Identify", "Contrast", "Estimate", "Judge", "Predict",
    "Defend", "Question", "Analyse", "Reflect", "Review",
)
_SUFFIX_BODY = (
    " in one short sentence would a careful reader answer the question about the passage "
    "above, considering the details it gives and what it leaves unsaid?"
)


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (a process did not start, a prompt is too long)."""


# ---- prompts ------------------------------------------------------------------------------


def make_prefix(loaded: LoadedModel, num_tokens: int, tag: str) -> list[int]:
    """Exactly ``num_tokens`` tokens of prose, starting with ``tag``: prompts with different
    tags differ from their first tokens on, so they share no block."""
    text = f"{tag}: reading notes.\n\n"
    section = 0
    ids: list[int] = []
    while len(ids) < num_tokens:
        for paragraph in PROSE:
            section += 1
            text += f"Section {section}. {paragraph}\n\n"
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    return ids[:num_tokens]


class SuffixSource:
    """A fresh ``num_tokens``-token question per request; leading words differ, so that no
    cache (ours or a peer's) can reuse any of one request's suffix for another."""

    def __init__(self, loaded: LoadedModel, num_tokens: int) -> None:
        self._loaded = loaded
        self._num_tokens = num_tokens
        self._count = 0

    def next(self) -> list[int]:
        i = self._count
        self._count += 1
        lead = _SUFFIX_LEADS[i % len(_SUFFIX_LEADS)]
        text = f"{lead}, for the {i + 1}th time,{_SUFFIX_BODY}"
        ids = self._loaded.tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < self._num_tokens:
            text += _SUFFIX_BODY
            ids = self._loaded.tokenizer.encode(text, add_special_tokens=False)
        return ids[: self._num_tokens]


# ---- results ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """One timed request."""

    seconds: float
    cached_tokens: int
    served_from: str
    server_ms: float | None = None


@dataclass(slots=True, kw_only=True)
class Row:
    """One line of a table: a system in one state, its samples, or why it has none."""

    label: str
    system: str
    samples: list[Sample] = field(default_factory=list)
    note: str | None = None
    tier: str | None = None
    """The tier a kvgate row is meant to be served from (what the targets check)."""

    @property
    def median_s(self) -> float | None:
        return statistics.median(s.seconds for s in self.samples) if self.samples else None

    @property
    def server_median_ms(self) -> float | None:
        values = [s.server_ms for s in self.samples if s.server_ms is not None]
        return statistics.median(values) if values else None

    @property
    def cached_text(self) -> str:
        counts = sorted({s.cached_tokens for s in self.samples})
        return "/".join(str(c) for c in counts) if counts else "-"

    @property
    def served_text(self) -> str:
        counts = Counter(s.served_from for s in self.samples)
        if len(counts) == 1:
            return next(iter(counts))
        return ", ".join(f"{where} x{n}" for where, n in counts.most_common())

    @property
    def is_served_as_meant(self) -> bool:
        """Every sample came (entirely) from the intended tier."""
        if self.tier is None or not self.samples:
            return False
        return all(s.served_from == f"{self.tier}:{s.cached_tokens}" and s.cached_tokens > 0
                   for s in self.samples)


@dataclass(slots=True, kw_only=True)
class LengthResult:
    prefix_tokens: int
    rows: list[Row] = field(default_factory=list)

    def row(self, label: str) -> Row | None:
        return next((r for r in self.rows if r.label == label), None)


COLD = "kvgate cold (no_cache)"
DEVICE = "kvgate warm: device"
HOST = "kvgate warm: host"
DISK = "kvgate warm: disk"
REDIS = "kvgate warm: redis"
HF_COLD = "HF recipe cold"
HF_WARM = "HF recipe warm (deepcopy)"
LLAMA_COLD = "llama.cpp cold"
LLAMA_RAM = "llama.cpp RAM-cache warm"
LLAMA_DISK = "llama.cpp disk-cache warm"
_COLD_OF = {"kvgate": COLD, "hf": HF_COLD, "llama.cpp": LLAMA_COLD}


# ---- the gateway ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """A gateway to measure, and what the benchmark may do to it."""

    host: str
    port: int
    api_key: str | None
    admin_key: str | None
    tenant: str
    why_no_redis: str | None = None


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
        row = Row(label=HOST, system="kvgate", tier="host")
        if self._admin is None:
            row.note = "n/a (needs --admin-key, or --spawn)"
            return row
        stats = self._stats()
        assert stats is not None
        budgets = {t.name: t.budget_bytes for t in stats.tiers}
        if "host" not in budgets:
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
            self._check_tiers(prefix, "host")
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
            self._force(prefix, evict=tuple(t for t in ("host", "device") if t in tiers))
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
        local = tuple(t for t in ("device", "host", "disk") if t in tiers)
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


# ---- spawning a gateway -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _stop(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM by pid, then SIGKILL after ``grace_s``."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextmanager
def redis_on_loopback(binary: str, workdir: Path) -> Iterator[str]:
    """A throwaway ``redis-server`` (no persistence) on a free loopback port; yields its URL."""
    port = _free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir), "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                raise BenchError(f"{binary} exited with status {proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"{binary} did not answer on 127.0.0.1:{port}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc, grace_s=10)


def spawn_config(*, block_tokens: int, device_bytes: int, redis_url: str | None,
                 api_key: str, admin_key: str) -> str:
    """The ``kvgate serve`` configuration of a spawned gateway (TOML)."""
    lines = [
        "[grpc]",
        "shutdown_grace_s = 5.0",
        "",
        "[cache]",
        f"block_tokens = {block_tokens}",
        f"device_bytes = {device_bytes}",
        'host_bytes = "4GiB"',
        'disk_bytes = "8GiB"',
    ]
    if redis_url is not None:
        # Loopback Redis moving a whole 4,096-token prefix (~190 MB) in one pipeline: give each
        # socket read more than the 0.25 s default meant to bound a stalled remote Redis.
        lines += [f'redis_url = "{redis_url}"', "redis_timeout_s = 10.0"]
    lines += [
        "",
        "[[api_keys]]",
        f'tenant = "{SPAWN_TENANT}"',
        f'key = "{api_key}"',
        "",
        "[[admin_keys]]",
        'name = "bench-admin"',
        f'key = "{admin_key}"',
        "",
    ]
    return "\n".join(lines)


@contextmanager
def spawn_gateway(*, model: str, models_dir: Path, block_tokens: int, device_bytes: int,
                  redis_url: str | None, redis_binary: str | None, err: TextIO,
                  start_timeout_s: float = 600.0) -> Iterator[Endpoint]:
    """``kvgate serve`` (and a ``redis-server``) on free loopback ports, with a temporary data
    directory whose ``models`` is ``models_dir`` (no second GGUF conversion); stopped by pid.
    """
    root = Path(tempfile.mkdtemp(prefix="kvgate-bench-ttft-"))
    try:
        with _maybe_redis(redis_url, redis_binary, root / "redis") as (url, why_no_redis):
            data_dir = root / "data"
            data_dir.mkdir(mode=0o700)
            models_dir.mkdir(parents=True, exist_ok=True)
            (data_dir / "models").symlink_to(models_dir.resolve(), target_is_directory=True)
            api_key = "kvg-bench-" + secrets.token_urlsafe(24)
            admin_key = "kvg-bench-admin-" + secrets.token_urlsafe(24)
            config = root / "kvgate.toml"
            config.write_text(spawn_config(block_tokens=block_tokens, device_bytes=device_bytes,
                                           redis_url=url, api_key=api_key, admin_key=admin_key),
                              encoding="utf-8")
            config.chmod(0o600)
            model_arg = model if model == "bundled" else str(Path(model).expanduser().resolve())
            env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
            log = root / "serve.log"
            with log.open("wb") as log_fh:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "gateway.cli.main", "serve", "--config", str(config),
                     "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir),
                     "--model", model_arg],
                    stdout=subprocess.DEVNULL, stderr=log_fh, env=env,
                )
            try:
                port = _wait_serving(proc, log, start_timeout_s)
                err.write(f"[ttft] spawned kvgate serve (pid {proc.pid}) on 127.0.0.1:{port}"
                          f"{', redis ' + url if url else ''}\n")
                yield Endpoint(host="127.0.0.1", port=port, api_key=api_key,
                               admin_key=admin_key, tenant=SPAWN_TENANT,
                               why_no_redis=why_no_redis)
            finally:
                _stop(proc, grace_s=30)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextmanager
def _maybe_redis(url: str | None, binary: str | None,
                 workdir: Path) -> Iterator[tuple[str | None, str | None]]:
    if url is not None:
        yield url, None
        return
    if binary is None:
        yield None, "no redis-server on PATH and no --redis-url"
        return
    with redis_on_loopback(binary, workdir) as started:
        yield started, None


def _wait_serving(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(encoding="utf-8", errors="replace")
        match = _SERVING.search(text)
        if match:
            return int(match.group(1))
        if proc.poll() is not None:
            raise BenchError(f"kvgate serve exited with status {proc.returncode}:\n"
                             + text[-2000:])
        time.sleep(0.1)
    raise BenchError(f"kvgate serve did not start within {timeout_s:.0f} s:\n"
                     + log.read_text(encoding="utf-8", errors="replace")[-2000:])


# ---- transformers' prompt-reuse recipe -----------------------------------------------------


def _first_token(loaded: LoadedModel, token_ids: Sequence[int], cache: Any) -> tuple[int, Any]:
    with torch.inference_mode():
        out = loaded.model(input_ids=torch.tensor([list(token_ids)], dtype=torch.long),
                           past_key_values=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax()), out.past_key_values


def hf_recipe_rows(loaded: LoadedModel, prefix: list[int], suffixes: SuffixSource,
                   repeats: int, err: TextIO) -> list[Row]:
    """Cold: the whole prompt in one forward. Warm: the documented recipe -- the prefix's
    ``DynamicCache`` computed once, ``copy.deepcopy``'d per request, the suffix run on it."""
    cold = Row(label=HF_COLD, system="hf")
    warm = Row(label=HF_WARM, system="hf")
    for i in range(repeats):
        began = time.perf_counter()
        _first_token(loaded, prefix + suffixes.next(), None)
        cold.samples.append(Sample(seconds=time.perf_counter() - began, cached_tokens=0,
                                   served_from="-"))
        err.write(f"[ttft] {len(prefix)}: HF recipe cold {i + 1}/{repeats}: "
                  f"{cold.samples[-1].seconds * 1e3:.1f} ms\n")
    _, prefix_cache = _first_token(loaded, prefix, None)
    for i in range(repeats):
        began = time.perf_counter()
        cache = copy.deepcopy(prefix_cache)
        num_cached = int(cache.get_seq_length())
        _first_token(loaded, suffixes.next(), cache)
        warm.samples.append(Sample(seconds=time.perf_counter() - began,
                                   cached_tokens=num_cached, served_from="DynamicCache copy"))
        err.write(f"[ttft] {len(prefix)}: HF recipe warm {i + 1}/{repeats}: "
                  f"{warm.samples[-1].seconds * 1e3:.1f} ms\n")
    return [cold, warm]


# ---- llama.cpp (llama-cpp-python in its own venv) ------------------------------------------


def _llama_cpp_worker() -> None:
    """Runs in the peers venv (stdlib and llama_cpp only): a JSON spec on stdin, results on
    stdout. Every completion is one token, streamed; TTFT is the time to its first chunk (the
    cache saves its state after the last chunk, outside the timing)."""
    import importlib
    import json
    import os
    import shutil
    import sys
    import tempfile
    import time

    llama_cpp = importlib.import_module("llama_cpp")
    spec = json.load(sys.stdin)
    progress = sys.stderr
    sys.stderr = open(os.devnull, "w")  # LlamaDiskCache prints on every put
    llm = llama_cpp.Llama(model_path=spec["gguf"], n_ctx=spec["n_ctx"], n_batch=512,
                          n_threads=spec["threads"], n_threads_batch=spec["threads"],
                          verbose=False)

    num_evaluated = [0]
    evaluate = llm.eval

    def counting_eval(tokens: list[int]) -> None:
        num_evaluated[0] += len(tokens)
        evaluate(tokens)

    llm.eval = counting_eval  # what the prompt cache did not supply is evaluated here

    def timed(prompt: list[int]) -> list[float]:
        llm.reset()  # forget the context's own tokens: only the prompt cache may help
        num_evaluated[0] = 0
        began = time.perf_counter()
        stream = llm.create_completion(prompt, max_tokens=1, temperature=0.0, stream=True)
        next(stream, None)
        elapsed = time.perf_counter() - began
        num_cached = len(prompt) - num_evaluated[0]
        for _ in stream:
            pass
        return [elapsed, float(num_cached)]

    def say(text: str) -> None:
        progress.write(f"[ttft] {text}\n")
        progress.flush()

    results: dict[str, dict[str, list[list[float]]]] = {}
    scratch = tempfile.mkdtemp(prefix="kvgate-bench-llama-cache-")
    try:
        llm.set_cache(None)
        timed(spec["warmup"])
        for case in spec["cases"]:
            prefix = case["prefix"]
            n = len(prefix)
            out: dict[str, list[list[float]]] = {"cold": [], "ram": [], "disk": []}
            llm.set_cache(None)
            for i, suffix in enumerate(case["cold"]):
                out["cold"].append(timed(prefix + suffix))
                say(f"{n}: llama.cpp cold {i + 1}/{len(case['cold'])}: "
                    f"{out['cold'][-1][0] * 1e3:.1f} ms")
            caches = (
                ("ram", llama_cpp.LlamaRAMCache(capacity_bytes=spec["cache_bytes"])),
                ("disk", llama_cpp.LlamaDiskCache(cache_dir=f"{scratch}/{n}",
                                                  capacity_bytes=spec["cache_bytes"])),
            )
            for name, cache in caches:
                llm.set_cache(cache)
                timed(prefix)  # fills the cache with the prefix's state
                for i, suffix in enumerate(case[name]):
                    out[name].append(timed(prefix + suffix))
                    say(f"{n}: llama.cpp {name}-cache warm {i + 1}/{len(case[name])}: "
                        f"{out[name][-1][0] * 1e3:.1f} ms")
            llm.set_cache(None)
            results[str(n)] = out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    json.dump({"version": llama_cpp.__version__, "results": results}, sys.stdout)


def peers_python(explicit: Path | None = None) -> tuple[Path | None, str]:
    """The interpreter with llama_cpp, or None and why not."""
    python = explicit if explicit is not None else (
        Path(__file__).resolve().parents[2] / PEERS_VENV / "bin" / "python")
    if not python.is_file():
        return None, "n/a (run make bench-peers)"
    probe = subprocess.run([str(python), "-c", "import llama_cpp"], capture_output=True,
                           timeout=120, check=False)
    if probe.returncode != 0:
        return None, "n/a (run make bench-peers: llama_cpp does not import)"
    return python, ""


def llama_cpp_rows(python: Path, gguf: Path, cases: list[tuple[list[int], SuffixSource]],
                   repeats: int, err: TextIO) -> tuple[dict[int, list[Row]], str]:
    """Run the llama.cpp reference for every length in one subprocess (one model load)."""
    longest = max(len(prefix) for prefix, _ in cases)
    spec = {
        "gguf": str(gguf),
        "n_ctx": -(-(longest + 64) // 256) * 256,
        "threads": LLAMA_CPP_THREADS,
        "cache_bytes": 8 << 30,
        "warmup": cases[0][0][:32],
        "cases": [
            {"prefix": prefix,
             **{name: [suffixes.next() for _ in range(repeats)]
                for name in ("cold", "ram", "disk")}}
            for prefix, suffixes in cases
        ],
    }
    source = textwrap.dedent(inspect.getsource(_llama_cpp_worker)) + "\n_llama_cpp_worker()\n"
    proc = subprocess.run([str(python), "-c", source], input=json.dumps(spec), text=True,
                          stdout=subprocess.PIPE, stderr=None if err is sys.stderr else
                          subprocess.PIPE, cwd=tempfile.gettempdir(), check=False)
    if proc.returncode != 0:
        raise BenchError(f"the llama.cpp reference failed (status {proc.returncode})"
                         + (f":\n{proc.stderr[-2000:]}" if proc.stderr else ""))
    if proc.stderr:
        err.write(proc.stderr)
    answer = json.loads(proc.stdout)
    rows: dict[int, list[Row]] = {}
    for key, out in answer["results"].items():
        labelled = ((LLAMA_COLD, "cold", "-"), (LLAMA_RAM, "ram", "LlamaRAMCache"),
                    (LLAMA_DISK, "disk", "LlamaDiskCache"))
        rows[int(key)] = [
            Row(label=label, system="llama.cpp", samples=[
                Sample(seconds=s, cached_tokens=int(c), served_from=where if c else "-")
                for s, c in out[name]
            ])
            for label, name, where in labelled
        ]
    return rows, str(answer["version"])


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
        cold = result.row(_COLD_OF[row.system])
        median = row.median_s
        cold_s = cold.median_s if cold is not None else None
        ratio = f"{median / cold_s:.3f}" if median is not None and cold_s else "-"
        server = row.server_median_ms
        out.write(
            f"{row.label:<36} {_ms(median):>10} {ratio:>7} "
            f"{'-' if server is None else f'{server:,.1f}':>10} {row.cached_text:>7}  "
            f"{row.served_text}\n"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    name: str
    row: str
    reference: str
    factor: float


TARGETS = (
    Target(name="warm device <= 1.3x HF recipe warm", row=DEVICE, reference=HF_WARM, factor=1.3),
    Target(name="warm device <= 5% of cold", row=DEVICE, reference=COLD, factor=0.05),
    Target(name="warm disk <= 10% of cold", row=DISK, reference=COLD, factor=0.10),
    Target(name="warm redis <= 12% of cold", row=REDIS, reference=COLD, factor=0.12),
    Target(name="warm device <= llama.cpp RAM cache", row=DEVICE, reference=LLAMA_RAM,
           factor=1.0),
    Target(name="warm host <= llama.cpp RAM cache", row=HOST, reference=LLAMA_RAM, factor=1.0),
    Target(name="warm disk <= llama.cpp disk cache", row=DISK, reference=LLAMA_DISK,
           factor=1.0),
)


def print_targets(results: Sequence[LengthResult], out: TextIO) -> dict[str, str]:
    """PASS / MISS per target at 2,048 tokens (information, not an assertion)."""
    verdicts: dict[str, str] = {}
    result = next((r for r in results if r.prefix_tokens == TARGET_LENGTH), None)
    out.write(f"\ntargets at {TARGET_LENGTH:,} tokens (information only):\n")
    if result is None:
        out.write(f"  not measured: add {TARGET_LENGTH} to --lengths\n")
        return verdicts
    for target in TARGETS:
        row, ref = result.row(target.row), result.row(target.reference)
        value = row.median_s if row is not None else None
        limit = ref.median_s if ref is not None else None
        if row is None or value is None:
            verdict, detail = "n/a", f"{target.row}: not measured"
        elif not row.is_served_as_meant:
            verdict, detail = "n/a", f"served from {row.served_text}, not {row.tier}"
        elif limit is None:
            verdict, detail = "n/a", f"{target.reference}: not measured"
        else:
            bound = limit * target.factor
            verdict = "PASS" if value <= bound else "MISS"
            detail = f"{_ms(value)} ms vs {_ms(bound)} ms"
        verdicts[target.name] = verdict
        out.write(f"  {verdict:<5} {target.name:<38} {detail}\n")
    return verdicts


# ---- the run -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class TtftOptions:
    """What ``kvgate bench ttft`` measures and against which gateway (see ``--help``)."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    suffix_tokens: int = 32
    repeats: int = 3
    block_tokens: int = 256
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


def run_ttft_benchmark(options: TtftOptions, *, out: TextIO, err: TextIO) -> list[LengthResult]:
    """Measure every row of every length, print one table per length and the targets.

    Raises:
        BenchError: a process did not start, or a length does not fit the model.
        gateway.client.KvgateError: a call to the gateway failed.
        gateway.engine.model.ModelLoadError: the model cannot be loaded.
    """
    if options.repeats < 1 or not options.lengths or options.suffix_tokens < 1:
        raise BenchError("--repeats, --lengths and --suffix-tokens must be positive")
    bt = options.block_tokens
    busy_before = cpu_busy_fraction()
    if busy_before is not None and busy_before > 0.25:
        err.write(f"[ttft] warning: the CPU is {busy_before:.0%} busy before starting: other "
                  "processes are using it, and every figure will be noisy\n")
    err.write(f"[ttft] loading {options.model} in this process (HF recipe, tokenizer) ...\n")
    loaded = load_model(options.model, cache_dir=options.data_dir / "models")
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
        for result in results:
            n = result.prefix_tokens
            result.rows += bench.measure(loaded, prefixes[n], suffixes[n], options.repeats,
                                         filler_tag=f"Filler {nonce}")
            result.rows += hf_recipe_rows(loaded, prefixes[n], suffixes[n], options.repeats, err)

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

    _print_report(options, loaded, results, endpoint, version, (busy_before, cpu_busy_fraction()),
                  out)
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
                       redis_url=options.redis_url, redis_binary=binary, err=err) as endpoint:
        yield endpoint


def _gguf_of(model: str) -> Path | None:
    try:
        source = resolve_source(model)
    except ModelLoadError:
        return None
    return source.directory / source.gguf_file if source.gguf_file is not None else None


def _print_report(options: TtftOptions, loaded: LoadedModel, results: Sequence[LengthResult],
                  endpoint: Endpoint, llama_version: str,
                  busy: tuple[float | None, float | None], out: TextIO) -> None:
    where = ("spawned gateway" if options.spawn
             else f"gateway at {endpoint.host}:{endpoint.port}")
    out.write(
        f"kvgate bench ttft: model {loaded.name} ({loaded.layout.num_layers} layers, "
        f"{loaded.layout.kv_heads} KV heads x {loaded.layout.head_dim}, "
        f"{loaded.layout.dtype}), {where}, blocks of {options.block_tokens} tokens; "
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
    print_targets(results, out)
    out.write(
        "\nTTFT ms: kvgate rows from the client's call to the first streamed item (gRPC on "
        "loopback), the references in process; server ms: the gateway's own usage.ttft_ms. "
        "x cold: against the same system's cold row. served from: what each response's usage "
        "said (cached_tokens_by_tier). Host is forced by a filler prompt that fills the device "
        "tier, disk by evicting host+device, Redis by evicting every local tier; disk reads "
        "likely come from the page cache.\n"
    )
