"""``kvgate bench tiers``: put/get of a real 2,048-token prefix per tier, beside raw limits.

The KV is real: the bundled SmolLM2-135M (or ``--model``) prefills a 2,048-token prompt in
block-aligned chunks, giving 8 blocks of 256 tokens (~94 MB in float32). Every tier is timed in
the same run as the plain operation it is built on, so the printed ratios survive a noisy
machine: a tensor clone for the memory tiers, a plain file write (with the same fsync) and read
of the same encoded bytes for the disk tier, plain redis-py SET/GET of the same bytes for Redis.
Each figure is the median of ``--repeats`` runs.

With matplotlib (the ``plot`` extra) the table is also drawn as a PNG (``plot_tiers``): per tier
and operation, kvgate's time beside the raw limit's.

The codec table shows what authenticating a block costs: encode and decode per block, the block
MAC alone (keyed BLAKE3 over header and payload) and its share of each, beside the keyed
functions it was chosen over (HMAC-SHA256, keyed BLAKE2b) on the same bytes.

The model and the K/V run on ``--device`` in ``--dtype`` (``gateway.bench.numerics``; ``auto``
as for ``kvgate serve``): the device tier and the request's copy live there, the host tier is
pinned on a GPU, so host put/get and promotion cross the bus as they do when serving, and every
timing ends once the device is done. The codec, disk and Redis rows encode the prefix's host
(CPU) copy, so that they measure storage and the codec, not the bus (the memory rows do).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from gateway.bench.numerics import BenchNumerics, resolve_numerics
from gateway.bench.plotting import new_figure, save_figure
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import compute_block_kv, load_model
from policies.base import BlockKey
from tiers.base import BlockMeta
from tiers.codec import BlockCodec, derive_mac_key
from tiers.disk import DiskStore
from tiers.kinds.host import HOST
from tiers.memory import DeviceStore, HostStore
from tiers.page_pool import PagePool
from tiers.payload import KVBlock, KVLayout

SECRET = b"kvgate-bench-secret-000000000000"
PROMPT_TEXT = (
    "The prefix cache keeps the attention keys and values of prompts that many requests share, "
    "so that only the new suffix of each request is computed. System prompts, tool definitions, "
    "long documents and the earlier turns of a conversation are the usual shared prefixes. "
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    tier: str
    operation: str
    seconds: float
    num_bytes: int
    limit_name: str
    limit_seconds: float

    @property
    def ratio(self) -> float:
        return self.seconds / self.limit_seconds if self.limit_seconds > 0 else float("nan")


def _median_s(fn: Callable[[], object], repeats: int, setup: Callable[[], object] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of ``fn``; ``clock`` waits for the device where ``fn`` runs work there."""
    samples = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        start = clock()
        fn()
        samples.append(clock() - start)
    return statistics.median(samples)


def _metas(blocks: Sequence[KVBlock], tokens: torch.Tensor, block_tokens: int) -> list[BlockMeta]:
    metas = []
    parent = BlockKey(bytes(16))
    for i in range(len(blocks)):
        key = BlockKey(i.to_bytes(2, "little") + os.urandom(14))
        chunk = tokens[i * block_tokens : (i + 1) * block_tokens].to(torch.int64)
        metas.append(
            BlockMeta(
                key=key,
                parent_key=parent,
                namespace_digest=b"b" * 32,
                owner="bench",
                tokens=chunk.numpy().astype("<u4").tobytes(),
            )
        )
        parent = key
    return metas


def _on_cpu(block: KVBlock) -> KVBlock:
    """``block`` in CPU memory (itself when it is there already)."""
    return KVBlock(keys=tuple(t.cpu() for t in block.keys),
                   values=tuple(t.cpu() for t in block.values))


def _clone(blocks: Sequence[KVBlock]) -> list[KVBlock]:
    return [KVBlock(keys=tuple(t.clone() for t in b.keys),
                    values=tuple(t.clone() for t in b.values)) for b in blocks]


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecRow:
    """One codec operation, per block; ``mac_share`` = block MAC time / this operation's time."""

    operation: str
    seconds_per_block: float
    block_bytes: int
    mac_share: float | None


def codec_rows(blocks: Sequence[KVBlock], metas: Sequence[BlockMeta], codec: BlockCodec,
               repeats: int) -> list[CodecRow]:
    """Time encode, decode and the block MAC alone per block (on one thread, as encode tags
    and an engine on the CPU verifies; on every core, as an engine on a GPU verifies), and the
    MAC's share of each (decode's: of the MAC as ``codec`` verifies)."""
    pairs = list(zip(metas, blocks, strict=True))
    blobs = [codec.encode(m, b) for m, b in pairs]
    parts = []
    for blob in blobs:
        header, view = codec.read_header(blob), memoryview(blob)
        parts.append((view[: header.body_len], view[header.header_len :]))
    payloads = [payload for _, payload in parts]
    key = bytes(32)
    num = len(blobs)

    def per_block(fn: Callable[[], object]) -> float:
        return _median_s(fn, repeats) / num

    encode_s = per_block(lambda: [codec.encode(m, b) for m, b in pairs])
    decode_s = per_block(lambda: [codec.decode(blob, m) for blob, (m, _) in
                                  zip(blobs, pairs, strict=True)])
    mac_s = per_block(lambda: [codec.mac.block_tag(body, (payload,)) for body, payload in parts])
    verify_s = per_block(lambda: [codec.mac.block_tag(body, (payload,), every_core=True)
                                  for body, payload in parts])
    hmac_s = per_block(lambda: [hmac.new(key, p, "sha256").digest() for p in payloads])
    blake2_s = per_block(lambda: [hashlib.blake2b(p, key=key, digest_size=32).digest()
                                  for p in payloads])
    size = len(payloads[0])
    return [
        CodecRow(operation="encode", seconds_per_block=encode_s, block_bytes=size,
                 mac_share=mac_s / encode_s),
        CodecRow(operation="decode (verified)", seconds_per_block=decode_s, block_bytes=size,
                 mac_share=(verify_s if codec.mac.verifies_on_every_core else mac_s) / decode_s),
        CodecRow(operation="block MAC: keyed BLAKE3", seconds_per_block=mac_s, block_bytes=size,
                 mac_share=None),
        CodecRow(operation="  on every core (GPU)", seconds_per_block=verify_s,
                 block_bytes=size, mac_share=None),
        CodecRow(operation="  vs HMAC-SHA256", seconds_per_block=hmac_s, block_bytes=size,
                 mac_share=None),
        CodecRow(operation="  vs keyed BLAKE2b", seconds_per_block=blake2_s, block_bytes=size,
                 mac_share=None),
    ]


def write_codec_table(rows: Sequence[CodecRow], out: TextIO) -> None:
    out.write(f"codec, per block of {rows[0].block_bytes / 1e6:.1f} MB payload:\n")
    out.write(f"{'operation':<24} {'ms/block':>9} {'GB/s':>6} {'MAC share':>10}\n")
    for row in rows:
        share = "" if row.mac_share is None else f"{row.mac_share * 100:.0f}%"
        out.write(f"{row.operation:<24} {row.seconds_per_block * 1e3:>9.2f} "
                  f"{row.block_bytes / row.seconds_per_block / 1e9:>6.1f} {share:>10}\n")
    out.write("\n")


def _memory_rows(blocks: list[KVBlock], metas: list[BlockMeta], layout: KVLayout,
                 block_tokens: int, repeats: int, numerics: BenchNumerics) -> list[Row]:
    """The host and device tiers as ``kvgate serve`` builds them for ``numerics.device``
    (``blocks`` live there): the host tier pinned on a GPU, serving to the device."""
    total = sum(b.nbytes for b in blocks)
    clock = numerics.clock
    clone_s = _median_s(lambda: _clone(blocks), repeats, clock=clock)
    rows = []
    on_gpu = numerics.device.type == "cuda"
    host = HostStore(name=HOST, layout=layout, block_tokens=block_tokens, budget_bytes=2 * total,
                     pin=on_gpu, serve_device=numerics.device)
    device = DeviceStore(device=numerics.device)

    def host_put_all() -> None:
        for meta, block in zip(metas, blocks, strict=True):
            host.put(meta, block)

    def host_clear() -> None:
        for meta in metas:
            host.delete(meta.key)

    def promote_all() -> None:
        for meta in metas:
            block = host.get(meta)
            assert block is not None
            device.put(meta, block)

    def device_clear() -> None:
        for meta in metas:
            device.delete(meta.key)

    host_put = _median_s(host_put_all, repeats, setup=host_clear, clock=clock)
    host_get = _median_s(lambda: [host.get(m) for m in metas], repeats, clock=clock)
    promote = _median_s(promote_all, repeats, setup=device_clear, clock=clock)
    capacity = len(blocks) * block_tokens + 32
    pool = PagePool(layout, page_tokens=block_tokens, device=numerics.device,
                    num_pages=-(-capacity // block_tokens))
    sequence_fill = _median_s(lambda: KVSequence.from_blocks(pool, blocks, capacity), repeats,
                              clock=clock)
    rows.append(Row(tier=HOST, operation="put", seconds=host_put, num_bytes=total,
                    limit_name="tensor clone", limit_seconds=clone_s))
    rows.append(Row(tier=HOST, operation="get", seconds=host_get, num_bytes=total,
                    limit_name="tensor clone", limit_seconds=clone_s))
    rows.append(Row(tier="host->device", operation="promote", seconds=promote, num_bytes=total,
                    limit_name="tensor clone", limit_seconds=clone_s))
    rows.append(Row(tier="device", operation="copy into request", seconds=sequence_fill,
                    num_bytes=total, limit_name="tensor clone", limit_seconds=clone_s))
    host.close()
    device.close()
    return rows


def _plain_write(directory: Path, blobs: list[bytes], fsync: bool) -> None:
    for i, blob in enumerate(blobs):
        path = directory / f"plain-{i}.bin"
        fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    if fsync:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _plain_read(directory: Path, count: int) -> list[bytes]:
    return [(directory / f"plain-{i}.bin").read_bytes() for i in range(count)]


def _disk_rows(blocks: list[KVBlock], metas: list[BlockMeta], codec: BlockCodec,
               root: Path, repeats: int) -> list[Row]:
    total = sum(b.nbytes for b in blocks)
    blobs = [codec.encode(m, b) for m, b in zip(metas, blocks, strict=True)]
    plain_dir = root / "plain"
    plain_dir.mkdir(parents=True)
    plain_put = _median_s(lambda: _plain_write(plain_dir, blobs, True), repeats)
    plain_get = _median_s(lambda: _plain_read(plain_dir, len(blobs)), repeats)
    store_dir = root / "store"

    def put_and_flush(store: DiskStore) -> None:
        for meta, block in zip(metas, blocks, strict=True):
            store.put(meta, block)
        store.flush()

    samples = []
    for _ in range(repeats):
        shutil.rmtree(store_dir, ignore_errors=True)
        with DiskStore(store_dir, codec) as store:
            start = time.perf_counter()
            put_and_flush(store)
            samples.append(time.perf_counter() - start)
    disk_put = statistics.median(samples)
    with DiskStore(store_dir, codec) as store:  # a restart: every get reads the file
        disk_get = _median_s(lambda: [store.get(m) for m in metas], repeats)
        assert all(store.get(m) is not None for m in metas)
    return [
        Row(tier="disk", operation="put (fsync)", seconds=disk_put, num_bytes=total,
            limit_name="plain write+fsync", limit_seconds=plain_put),
        Row(tier="disk", operation="get", seconds=disk_get, num_bytes=total,
            limit_name="plain read", limit_seconds=plain_get),
    ]


@contextmanager
def _redis_server(binary: str) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvgate-bench-redis-")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--protected-mode", "yes"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _redis_rows(blocks: list[KVBlock], metas: list[BlockMeta], codec: BlockCodec, url: str,
                repeats: int) -> list[Row]:
    import redis

    from tiers.redis_store import RedisStore

    total = sum(b.nbytes for b in blocks)
    blobs = [codec.encode(m, b) for m, b in zip(metas, blocks, strict=True)]
    client = redis.Redis.from_url(url, socket_timeout=30)
    try:
        def plain_set() -> None:
            pipe = client.pipeline(transaction=False)
            for i, blob in enumerate(blobs):
                pipe.set(f"plain:{i}", blob)
            pipe.execute()

        def plain_get() -> None:
            pipe = client.pipeline(transaction=False)
            for i in range(len(blobs)):
                pipe.get(f"plain:{i}")
            pipe.execute()

        set_s = _median_s(plain_set, repeats)
        get_s = _median_s(plain_get, repeats)
        store = RedisStore(codec, url=url, socket_timeout_s=30, connect_timeout_s=5)
        store.start()
        try:
            pairs = list(zip(metas, blocks, strict=True))
            put_s = _median_s(lambda: store.put_many(pairs), repeats,
                              setup=lambda: client.flushdb())
            fetch_s = _median_s(lambda: store.get_many(metas), repeats)
            assert all(b is not None for b in store.get_many(metas))
        finally:
            store.close()
    finally:
        client.close()
    return [
        Row(tier="redis", operation="put (pipelined)", seconds=put_s, num_bytes=total,
            limit_name="plain SET", limit_seconds=set_s),
        Row(tier="redis", operation="get (pipelined)", seconds=fetch_s, num_bytes=total,
            limit_name="plain GET", limit_seconds=get_s),
    ]


def plot_tiers(rows: Sequence[Row], path: Path, out: TextIO) -> bool:
    """kvgate's time beside the raw limit's for every tier and operation, as a PNG.

    Returns:
        False when matplotlib is not installed (nothing written).
    """
    figure = new_figure(path, out, size=(9, 0.7 * len(rows) + 1.5))
    if figure is None:
        return False
    ax = figure.subplots()
    names = [f"{row.tier}: {row.operation}\nvs {row.limit_name}" for row in rows][::-1]
    positions = list(range(len(names)))
    height = 0.38
    for offset, label, values, colour in (
        (height / 2, "kvgate", [row.seconds * 1e3 for row in rows][::-1], "tab:blue"),
        (-height / 2, "raw limit (same bytes, same run)",
         [row.limit_seconds * 1e3 for row in rows][::-1], "tab:gray"),
    ):
        bars = ax.barh([p + offset for p in positions], values, height=height, label=label,
                       color=colour)
        ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], padding=2, fontsize="small")
    ax.set_yticks(positions, names)
    ax.set_xlabel(f"ms for the whole prefix ({rows[0].num_bytes / 1e6:.1f} MB), median"
                  if rows else "ms")
    ax.grid(True, axis="x", alpha=0.3)
    ax.margins(x=0.15)
    ax.legend(fontsize="small", loc="best")
    save_figure(figure, path, out)
    return True


def run_tiers_benchmark(*, model: str, cache_dir: Path, repeats: int, out: TextIO,
                        prompt_tokens: int = 2048, block_tokens: int = 256,
                        redis_url: str | None = None, redis_binary: str | None = None,
                        plot: Path | None = None,
                        numerics: BenchNumerics | None = None) -> list[Row]:
    """Measure every tier on one real prefix and print the table (and, with ``plot``, draw it
    there as a PNG); returns the rows. The model and the K/V run on ``numerics`` (default:
    ``auto``, as ``kvgate serve`` resolves it)."""
    numerics = numerics or resolve_numerics()
    out.write(f"kvgate bench tiers: loading {model} {numerics.describe()} ...\n")
    out.flush()
    loaded = load_model(model, cache_dir=cache_dir, device=numerics.device,
                        dtype=numerics.dtype)
    text = PROMPT_TEXT
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < prompt_tokens:
        text += PROMPT_TEXT
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    tokens = torch.tensor(ids[:prompt_tokens])
    start = numerics.clock()
    kv = compute_block_kv(loaded, tokens.to(numerics.device), block_tokens)
    prefill_s = numerics.clock() - start
    blocks = [KVBlock(keys=k, values=v) for k, v in kv]
    metas = _metas(blocks, tokens, block_tokens)
    total = sum(b.nbytes for b in blocks)
    out.write(
        f"prefix: {prompt_tokens} tokens = {len(blocks)} blocks of {block_tokens}, "
        f"{total / 1e6:.1f} MB, K/V {numerics.describe()}; cold block-aligned prefill "
        f"{prefill_s:.2f} s; median of {repeats} runs per figure\n"
    )
    device_blocks, blocks = blocks, [_on_cpu(b) for b in blocks]  # what the codec rows encode
    codec = BlockCodec(mac_key=derive_mac_key(SECRET), layout=loaded.layout,
                       block_tokens=block_tokens,
                       device_type=numerics.device.type)  # verifies as serve's tiers do
    lz4 = BlockCodec(mac_key=derive_mac_key(SECRET), layout=loaded.layout,
                     block_tokens=block_tokens, compression="lz4")
    raw_size = sum(len(codec.encode(m, b)) for m, b in zip(metas, blocks, strict=True))
    lz4_size = sum(len(lz4.encode(m, b)) for m, b in zip(metas, blocks, strict=True))
    out.write(f"lz4 on this KV: {lz4_size / raw_size:.4f} of raw "
              f"({(1 - lz4_size / raw_size) * 100:.1f}% saved) -> raw storage is the default\n\n")
    write_codec_table(codec_rows(blocks, metas, codec, repeats), out)
    out.flush()
    rows = _memory_rows(device_blocks, metas, loaded.layout, block_tokens, repeats, numerics)
    cache_dir.mkdir(parents=True, exist_ok=True)  # a checkpoint directory's load writes nothing
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-disk-", dir=cache_dir) as tmp:
        rows += _disk_rows(blocks, metas, codec, Path(tmp), repeats)
    binary = redis_binary or shutil.which("redis-server")
    if redis_url is not None:
        rows += _redis_rows(blocks, metas, codec, redis_url, repeats)
    elif binary is not None:
        with _redis_server(binary) as url:
            rows += _redis_rows(blocks, metas, codec, url, repeats)
    else:
        out.write("redis: skipped (no redis-server on PATH and no --redis-url)\n")
    header = (f"{'tier':<13} {'operation':<18} {'kvgate':>9} {'GB/s':>6}   "
              f"{'raw limit':<18} {'limit':>9} {'ratio':>6}\n")
    out.write(header)
    out.write("-" * (len(header) - 1) + "\n")
    for row in rows:
        out.write(
            f"{row.tier:<13} {row.operation:<18} {row.seconds * 1e3:>7.1f}ms "
            f"{row.num_bytes / row.seconds / 1e9:>6.1f}   {row.limit_name:<18} "
            f"{row.limit_seconds * 1e3:>7.1f}ms {row.ratio:>5.2f}x\n"
        )
    out.write(
        "\nratio = kvgate time / raw limit time, same bytes, same run. The device tier and the "
        f"request's copy are {numerics.describe()}; the host tier is CPU memory"
        f"{' (pinned)' if numerics.device.type == 'cuda' else ''}; the codec, disk and Redis "
        "rows encode the prefix's CPU copy.\n"
    )
    if plot is not None:
        plot_tiers(rows, plot, out)
    return rows
