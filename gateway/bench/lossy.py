"""``kvgate bench lossy``: what an int8 (or fp8) lower tier saves, and what it loses (issue 28).

Three measurements on the bundled SmolLM2-135M (or ``--model``), in process, in one run:

1. **Bytes per token**: one real block of the prompt's K/V encoded by an exact tier's codec and
   by a lossy one's (``BlockCodec(..., quantize=...)``): payload and whole blob (header and
   MACs included) per token, and the ratio, beside the formula of ``tiers/kv_quant.py``.
2. **Warm TTFT from disk and Redis**, ``--tokens`` cached tokens plus a fresh question,
   ``max_tokens=1``, read from each request's ``Usage.ttft_ms`` (submission to first token):
   a real ``Engine`` over ``open_cache`` per configuration, an exact one (device, host, disk,
   Redis) and a lossy one (the same, its disk and Redis tiers of ``--format``), each with a
   second replica without a disk that reads from the same Redis. First an exact request stores
   the prefix in each configuration (the lossy one writes its copies through to its disk and
   Redis); they stay there for every repeat. Then per repeat every row in turn, the order
   rotated by one per repeat: the device and host tiers of the replica that serves the row are
   evicted (an exact block has no tier below it in the lossy configuration and is dropped: only
   the lossy copies are left) and the prompt plus a new question is timed (with ``allow_lossy``
   for the lossy rows). The tier each request was served from is read from its usage and must
   be the one its row names (``disk`` / ``disk:int8``, ``redis`` / ``redis:int8``), or the run
   fails. Two reference rows: cold (``no_cache``), and device (the prefix already on the
   device: the question's own compute, which every warm row pays too). Every cache has
   ``skip_slow_tiers = false`` (loads are always measured, never skipped for recomputing), and
   shadow verification is off (it recomputes hits while the engine is idle).
3. **Quality** over ``--prompts`` chats through the model's chat template: a prose document
   as the system message (the paragraphs of ``gateway.bench.prompts``, one held out of each)
   and a question about it, ``--tokens`` of each prompt's tokens cached:
   (a) greedy agreement of 32 tokens with cold: a ``no_cache`` generation beside one whose
   prefix was served lossy by the engine (tokens equal before the first difference, and the
   fraction of positions equal); (b) the largest |logit| difference at the first generated step
   between the model run on the exact prefix K/V and on its lossy copy (the codec's own encode
   and decode); (c) the perplexity of the held-out paragraph given the prefix, on exact and on
   lossy K/V, and its relative change. (b) and (c) run the model directly
   (``compute_block_kv`` for the prefix, transformers' model over ``KVSequence`` pages).

Redis runs a ``redis-server`` of its own on a free loopback port (``--redis-server PATH``, or
the one on PATH), stopped by pid at the end; without one the Redis rows are skipped, saying so.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from gateway.bench.lossy_quality import (
    AGREEMENT_TOKENS,
    QualityRow,
    agreement,
    block_meta,
    direct_quality,
    quality_texts,
    write_quality_table,
)
from gateway.bench.numerics import BenchNumerics, resolve_numerics
from gateway.bench.prompts import PROSE, SuffixSource, make_prefix
from gateway.bench.rows import BenchError
from gateway.bench.spawn import redis_on_loopback
from gateway.cache.operations.factory import CacheConfig, OpenedCache, open_cache
from gateway.core.canonical import PromptInput
from gateway.core.fingerprint import Scope
from gateway.core.quantization import Quantization
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, TokenDelta, Usage
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.kv.sequence import pool_bytes_for
from gateway.engine.models.loading import LoadedModel, compute_block_kv, load_model
from gateway.engine.parity.verdicts import VerdictStore, cpu_identity
from tiers.codec import BlockCodec, derive_mac_key
from tiers.kinds.host import HOST
from tiers.kv_quant import quantized_bytes_per_token
from tiers.payload import KVBlock, KVLayout

SECRET = b"kvgate-bench-lossy-secret-000000"
SCOPE = Scope.of_tenant("bench")
COLD = "cold"
DEVICE = "device"
@dataclass(frozen=True, slots=True, kw_only=True)
class LossyOptions:
    """What ``kvgate bench lossy`` runs."""

    model: str
    data_dir: Path
    quantization: Quantization = "int8"
    tokens: int = 2048
    repeats: int = 5
    prompts: int = 3
    block_tokens: int = 64
    suffix_tokens: int = 32
    redis_binary: str | None = None
    """``redis-server`` to start; None: no Redis rows."""
    numerics: BenchNumerics | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BytesRow:
    """One block of ``block_tokens`` encoded exact and lossy (bytes of payload and blob)."""

    block_tokens: int
    dtype: str
    """The exact K/V's dtype (``float32``, ``bfloat16``)."""
    exact_payload: int
    lossy_payload: int
    exact_blob: int
    lossy_blob: int
    formula_ratio: float
    """``quantized_bytes_per_token`` over the layout's exact bytes per token."""

    @property
    def payload_ratio(self) -> float:
        return self.lossy_payload / self.exact_payload

    @property
    def blob_ratio(self) -> float:
        return self.lossy_blob / self.exact_blob


@dataclass(slots=True, kw_only=True)
class TtftRow:
    """One row of the TTFT table: ``tier`` is what every request's usage must name."""

    tier: str
    samples_ms: list[float] = field(default_factory=list)

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.samples_ms)


@dataclass(frozen=True, slots=True, kw_only=True)
class LossyResult:
    """Everything ``kvgate bench lossy`` measured."""

    quantization: Quantization
    bytes: BytesRow
    ttft: dict[str, TtftRow]
    redis_skipped: str | None
    quality: list[QualityRow]

    def ttft_ratio(self, tier: str) -> float:
        """The lossy tier's p50 over the exact tier's (``tier``: ``disk`` or ``redis``)."""
        return self.ttft[f"{tier}:{self.quantization}"].p50_ms / self.ttft[tier].p50_ms

    def load_ratio(self, tier: str) -> float:
        """``ttft_ratio`` of what each adds to the device row's p50 (the load, without the
        question's compute)."""
        device = self.ttft[DEVICE].p50_ms
        exact = self.ttft[tier].p50_ms - device
        if exact <= 0:
            return math.nan  # the exact load took no measurable time beyond the device row
        return (self.ttft[f"{tier}:{self.quantization}"].p50_ms - device) / exact


class Replica:
    """An engine over a cache of its own (closed with the bench)."""

    def __init__(self, loaded: LoadedModel, config: CacheConfig, *, numerics: BenchNumerics,
                 verdicts: VerdictStore, kv_budget_bytes: int) -> None:
        engine_config = EngineConfig(block_tokens=config.block_tokens,
                                     kv_budget_bytes=kv_budget_bytes, shadow_fraction=0.0)
        self.opened: OpenedCache = open_cache(
            config, layout=loaded.layout, deployment_secret=SECRET, device=numerics.device,
            running_bytes=pool_bytes_for(kv_budget_bytes + engine_config.tail_cache_bytes))
        self.engine = Engine(loaded=loaded, cache=self.opened.cache, config=engine_config,
                             deployment_secret=SECRET, verdicts=verdicts, pool=self.opened.pool)
        try:
            self.engine.start()
        except BaseException:
            self.opened.close()
            raise

    def generate(self, tokens: Sequence[int], *, max_tokens: int, allow_lossy: bool = False,
                 no_cache: bool = False) -> tuple[list[int], Usage]:
        ids: list[int] = []
        usage = None
        for event in self.engine.generate(GenerateRequest(
                prompt=PromptInput(token_ids=list(tokens)), scope=SCOPE,
                sampling=SamplingParams(max_tokens=max_tokens),
                cache=CacheOptions(allow_lossy=allow_lossy, no_cache=no_cache))):
            if isinstance(event, TokenDelta):
                ids.extend(event.token_ids)
            else:
                usage = event
        if usage is None:
            raise BenchError("a generation ended without its usage")
        # The usage comes before the request lets go of its blocks: until it has, an eviction
        # would leave them where they are.
        deadline = time.monotonic() + 60.0
        while self.engine.num_running:
            if time.monotonic() > deadline:
                raise BenchError("a finished request still runs after 60 s")
            time.sleep(0.002)
        return ids, usage

    def flush(self) -> None:
        if not self.opened.hierarchy.flush(timeout_s=120.0):
            raise BenchError("the cache's disk and Redis writes did not finish in 120 s")

    def drop_upper_tiers(self) -> None:
        """Evict everything from the device and host tiers (demoting what has a tier below),
        then wait for the writes: what is left is on disk and in Redis."""
        self.flush()
        self.opened.cache.evict("device", 1 << 50)
        self.opened.cache.evict(HOST, 1 << 50)
        self.flush()

    def close(self) -> None:
        self.engine.stop(grace_s=5.0)
        self.opened.close()


def run_lossy_benchmark(options: LossyOptions, *, out: TextIO) -> LossyResult:
    """Measure bytes, warm TTFT and quality, print the tables; returns what was measured."""
    numerics = options.numerics or resolve_numerics()
    q = options.quantization
    if options.tokens % options.block_tokens or options.tokens < options.block_tokens:
        raise BenchError(f"--tokens {options.tokens} must be a multiple of the block size "
                         f"{options.block_tokens}")
    if not 1 <= options.prompts <= len(PROSE):
        raise BenchError(f"--prompts must be 1..{len(PROSE)}, got {options.prompts}")
    out.write(f"kvgate bench lossy: loading {options.model} {numerics.describe()} ...\n")
    out.flush()
    loaded = load_model(options.model, cache_dir=options.data_dir / "models",
                        device=numerics.device, dtype=numerics.dtype)
    prefix = make_prefix(loaded, options.tokens, "lossy tiers")
    exact_codec, lossy_codec = (
        BlockCodec(mac_key=derive_mac_key(SECRET), layout=loaded.layout,
                   block_tokens=options.block_tokens, quantize=quantize)
        for quantize in (None, q))
    options.data_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="kvgate-bench-lossy-", dir=options.data_dir)))
        url = None
        if options.redis_binary is not None:
            url = stack.enter_context(redis_on_loopback(options.redis_binary, root / "redis"))
        replicas = stack.enter_context(open_replicas(loaded, options, numerics, root, url))
        out.write(f"machine: {cpu_identity().split(' [', 1)[0]}, {os.cpu_count()} CPU cores"
                  f"{', AVX2' if 'avx2' in cpu_identity() else ''}"
                  f"{', AVX-512' if 'avx512f' in cpu_identity() else ''}; model "
                  f"{options.model} {numerics.describe()}, engine route "
                  f"{replicas['exact'].engine.route.name}; lossy tiers {q}; load average "
                  f"{os.getloadavg()[0]:.1f} at the start\n")
        out.flush()
        first = compute_block_kv(loaded, torch.tensor(prefix[: options.block_tokens]),
                                 options.block_tokens)[0]
        row = bytes_row(loaded.layout, KVBlock(keys=first[0], values=first[1]),
                        prefix[: options.block_tokens], exact_codec, lossy_codec)
        write_bytes_table(row, q, out)
        ttft = _ttft_rows(replicas, options, prefix, SuffixSource(loaded, options.suffix_tokens),
                          out)
        quality = [_quality_row(loaded, replicas, options, lossy_codec, i, out)
                   for i in range(options.prompts)]
    result = LossyResult(quantization=q, bytes=row, ttft=ttft, quality=quality,
                         redis_skipped=None if url is not None else
                         "no redis-server on PATH and no --redis-server")
    write_ttft_table(result, options, out)
    write_quality_table(result.quality, q, options.tokens, out)
    out.write(f"load average {os.getloadavg()[0]:.1f} at the end (other work on the machine "
              "slows every row; the ratios are of rows measured side by side)\n")
    return result


@contextmanager
def open_replicas(loaded: LoadedModel, options: LossyOptions, numerics: BenchNumerics, root: Path,
                  redis_url: str | None) -> Iterator[dict[str, Replica]]:
    """``exact`` and ``lossy`` (``options.quantization``), each with disk (and Redis), and with
    Redis their second replicas ``exact-b`` and ``lossy-b`` (no disk)."""
    names = [("exact", False), ("lossy", True)]
    if redis_url is not None:
        names += [("exact-b", False), ("lossy-b", True)]
    budget = 4 * (options.tokens + 256) * loaded.layout.bytes_per_token
    verdicts = VerdictStore(options.data_dir / "routes", SECRET)  # as kvgate serve keeps them
    with ExitStack() as stack:
        replicas = {}
        for name, lossy in names:
            config = _cache_config(options, loaded.layout, root / f"{name}-disk", redis_url,
                                   lossy=lossy, disk=not name.endswith("-b"))
            replica = Replica(loaded, config, numerics=numerics, verdicts=verdicts,
                               kv_budget_bytes=budget)
            stack.callback(replica.close)
            replicas[name] = replica
        yield replicas


def _cache_config(options: LossyOptions, layout: KVLayout, disk_path: Path,
                  redis_url: str | None, *, lossy: bool, disk: bool) -> CacheConfig:
    """Device and host tiers, a disk tier at ``disk_path`` if ``disk``, Redis at
    ``redis_url``; with ``lossy``, the disk and Redis tiers in ``options.quantization``."""
    q = options.quantization
    quantize: dict[str, str] = {}
    if lossy:
        quantize = {tier: q for tier, present in (("disk", disk), ("redis", redis_url))
                    if present}
    prefix_bytes = options.tokens * layout.bytes_per_token
    return CacheConfig(
        block_tokens=options.block_tokens, skip_slow_tiers=False,
        device_bytes=4 * prefix_bytes, host_bytes=4 * prefix_bytes,
        disk_bytes=(4 * options.prompts + 8) * prefix_bytes if disk else 0,
        disk_path=disk_path if disk else None,
        redis_url=redis_url, redis_timeout_s=10.0, remote_write=True,
        redis_key_prefix="bench-lossy" if lossy else "bench-exact",
        write_queue_bytes=max(CacheConfig().write_queue_bytes, 4 * prefix_bytes),
        quantize=quantize)


# ---- bytes per token -------------------------------------------------------------------------


def bytes_row(layout: KVLayout, block: KVBlock, tokens: Sequence[int], exact: BlockCodec,
              lossy: BlockCodec) -> BytesRow:
    """``block`` (of ``tokens``) encoded by both codecs."""
    meta = block_meta(tokens)
    exact_blob, lossy_blob = (len(codec.encode(meta, block)) for codec in (exact, lossy))
    return BytesRow(
        block_tokens=len(tokens), dtype=str(layout.dtype).removeprefix("torch."),
        exact_payload=exact.raw_len, lossy_payload=lossy.raw_len,
        exact_blob=exact_blob, lossy_blob=lossy_blob,
        formula_ratio=quantized_bytes_per_token(layout.num_layers, layout.kv_heads,
                                                layout.head_dim) / layout.bytes_per_token)


def write_bytes_table(row: BytesRow, quantization: str, out: TextIO) -> None:
    n = row.block_tokens
    out.write(f"\nbytes per token: one block of {n} real tokens, encoded by each tier's codec "
              "(blob = header, MACs and payload)\n")
    out.write(f"{'format':<9} {'payload B/token':>15} {'blob B/token':>13}\n")
    for name, payload, blob in ((row.dtype, row.exact_payload, row.exact_blob),
                                (quantization, row.lossy_payload, row.lossy_blob)):
        out.write(f"{name:<9} {payload / n:>15,.1f} {blob / n:>13,.1f}\n")
    verdict = ("met" if row.blob_ratio <= 0.27 else "NOT met") if row.dtype == "float32" else (
        f"set for float32 K/V, not {row.dtype}")
    out.write(f"{quantization} / {row.dtype}: payload {row.payload_ratio:.4f}x (formula "
              f"{row.formula_ratio:.4f}x), blob {row.blob_ratio:.4f}x (target <= 0.27x: "
              f"{verdict})\n")
    out.flush()


# ---- warm TTFT -------------------------------------------------------------------------------


def _ttft_rows(replicas: dict[str, Replica], options: LossyOptions, prefix: list[int],
               suffixes: SuffixSource, out: TextIO) -> dict[str, TtftRow]:
    """Warm the prefix once per configuration, then per repeat every row in turn, in an order
    rotated by one per repeat: see the module docstring."""
    q = options.quantization
    names = [COLD, DEVICE, "disk", f"disk:{q}"]
    if "exact-b" in replicas:
        names += ["redis", f"redis:{q}"]
    rows = {name: TtftRow(tier=name) for name in names}
    for name in ("exact", "lossy"):
        # An exact request stores the prefix; the lossy configuration writes its copies through
        # to its disk and Redis. What is written stays there for every repeat.
        replicas[name].generate(prefix, max_tokens=1)
        replicas[name].drop_upper_tiers()
    for repeat in range(options.repeats):
        turn = repeat % len(names)
        for name in names[turn:] + names[:turn]:
            lossy = ":" in name
            replica = replicas[("lossy" if lossy else "exact")
                               + ("-b" if name.startswith("redis") else "")]
            if name == DEVICE:
                replica.generate(prefix, max_tokens=1)  # on the device now, wherever it was
            elif name != COLD:
                replica.drop_upper_tiers()  # left on disk and in Redis (lossy: copies only)
            _, usage = replica.generate(prefix + suffixes.next(), max_tokens=1,
                                        allow_lossy=lossy, no_cache=name == COLD)
            check_served(usage, name, len(prefix))
            rows[name].samples_ms.append(usage.ttft_ms)
        out.write(f"[lossy] TTFT repeat {repeat + 1}/{options.repeats}: "
                  + ", ".join(f"{n} {r.samples_ms[-1]:,.0f} ms" for n, r in rows.items())
                  + "\n")
        out.flush()
    return rows


def check_served(usage: Usage, tier: str, num_tokens: int) -> None:
    """Raise ``BenchError`` unless ``usage`` says ``num_tokens`` came from ``tier`` alone
    (``cold``: nothing cached), lossy exactly when the tier is a lossy one."""
    expected = {} if tier == COLD else {tier: num_tokens}
    if usage.cached_tokens_by_tier != expected or usage.lossy != (":" in tier):
        raise BenchError(f"meant to serve {num_tokens} tokens from {tier}, but the usage says "
                         f"{usage.cached_tokens_by_tier} (lossy={usage.lossy})")


def write_ttft_table(result: LossyResult, options: LossyOptions, out: TextIO) -> None:
    out.write(f"\nwarm TTFT: {options.tokens:,} cached tokens + a {options.suffix_tokens}-token "
              f"question, max_tokens 1 (Usage.ttft_ms; median of {options.repeats}, rows "
              "interleaved per repeat)\n")
    out.write(f"{'served from':<12} {'p50 ms':>9} {'- device':>9}   samples ms\n")
    device = result.ttft[DEVICE].p50_ms
    for name, row in result.ttft.items():
        samples = " ".join(f"{s:,.0f}" for s in row.samples_ms)
        beyond = "" if name in (COLD, DEVICE) else f"{row.p50_ms - device:,.1f}"
        out.write(f"{name:<12} {row.p50_ms:>9,.1f} {beyond:>9}   {samples}\n")
    if result.redis_skipped is not None:
        out.write(f"redis: skipped ({result.redis_skipped})\n")
    for tier in ("disk", "redis"):
        if tier in result.ttft:
            ratio = result.ttft_ratio(tier)
            out.write(f"{tier}:{result.quantization} / {tier} p50: {ratio:.2f}x (target <= 0.6x: "
                      f"{'met' if ratio <= 0.6 else 'NOT met'}); beyond the device row: "
                      f"{result.load_ratio(tier):.2f}x\n")
    out.write("device: the prefix already on the device, so its TTFT is the question's compute "
              "(and the engine's own); '- device' is what loading from the tier adds to it\n")
    out.flush()


# ---- quality ---------------------------------------------------------------------------------


def _quality_row(loaded: LoadedModel, replicas: dict[str, Replica], options: LossyOptions,
                 codec: BlockCodec, index: int, out: TextIO) -> QualityRow:
    """Quality prompt ``index``: its greedy answers through the engine, cold and served lossy
    from disk, and the direct measurements of ``gateway.bench.lossy_quality``."""
    q = options.quantization
    prefix, suffix, held_out = quality_texts(loaded, options.tokens, index)
    cold, usage = replicas["exact"].generate(prefix + suffix, max_tokens=AGREEMENT_TOKENS,
                                            no_cache=True)
    check_served(usage, COLD, len(prefix))
    writer = replicas["lossy"]
    writer.generate(prefix, max_tokens=1)
    writer.drop_upper_tiers()
    served, usage = writer.generate(prefix + suffix, max_tokens=AGREEMENT_TOKENS,
                                    allow_lossy=True)
    check_served(usage, f"disk:{q}", len(prefix))
    agreed, matched = agreement(cold, served, AGREEMENT_TOKENS)

    direct = direct_quality(loaded, prefix, suffix, held_out, codec, options.block_tokens)
    row = QualityRow(prompt=index + 1, cold_tokens=len(cold), lossy_tokens=len(served),
                     cold_text=loaded.tokenizer.decode(cold),
                     lossy_text=loaded.tokenizer.decode(served),
                     agreed=agreed, matched=matched, max_logit_diff=direct.max_logit_diff,
                     max_logit=direct.max_logit, same_first_argmax=direct.same_first_argmax,
                     ppl_exact=direct.ppl_exact, ppl_lossy=direct.ppl_lossy)
    out.write(f"[lossy] quality prompt {index + 1}/{options.prompts}: agreed {agreed}/"
              f"{AGREEMENT_TOKENS}, max |dlogit| {row.max_logit_diff:.4f}, perplexity "
              f"{row.ppl_exact:.3f} -> {row.ppl_lossy:.3f}\n")
    out.flush()
    return row


