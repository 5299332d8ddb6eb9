"""The parity harness: the prompts, the tiny Llama's cache and engine, and a spy on what a
warm request is served.

Shared by the engine tests and by ``tests.gateway.engine.redis_writer`` (the other process that
fills Redis), so that both sides use the same prompts, block size and deployment secret.

``ServedSpy`` wraps ``PrefixCache.load`` on one cache instance: it records, for the request that
loads, which tiers held each matched block at that moment (before anything was promoted) and
the K/V tensors handed to the request. That is what "served from tier X, bit for bit" means.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.cache.operations.factory import CacheConfig, OpenedCache
from gateway.cache.prefix_cache import Lease, PrefixCache
from gateway.config.dtype import resolve_dtype
from gateway.core.canonical import PromptInput, canonicalize
from gateway.core.fingerprint import Scope
from gateway.core.requests import CacheOptions, GenerateRequest, SamplingParams, TokenDelta, Usage
from gateway.engine.engine import Engine, EngineConfig
from gateway.engine.forward.batched import BatchedForward, SequenceRows
from gateway.engine.kv.sequence import KVSequence
from gateway.engine.models.loading import LoadedModel, compute_block_kv, load_model
from gateway.engine.parity.route_search import RouteVerdict, build_forward, search_route
from tiers.page_pool import PagePool
from tiers.payload import KVBlock

BLOCK = 16
SECRET = b"engine-test-secret-0000000000001"
ALICE = Scope.of_tenant("alice")
SYSTEM = "You are a careful assistant. Answer briefly and cite the manual. " * 2

# The parity prompts (docs/parity.md, "What the tests compare"): (id, prompt). Ids name the
# parametrised tests.
PARITY_PROMPTS: list[tuple[str, PromptInput]] = [
    ("shorter-than-a-block-text", PromptInput(prompt="short")),
    ("repeated-sentence", PromptInput(prompt="The quick brown fox jumps over the lazy dog. " * 8)),
    ("unicode", PromptInput(prompt="Ünïcödé ✓ — 東京 🚀 naïve café " * 3)),
    ("shared-system-prompt-1", PromptInput(messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a block?"}])),
    ("shared-system-prompt-2", PromptInput(messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a tier?"}])),
    ("multi-turn-chat", PromptInput(messages=[
        {"role": "user", "content": "Hi there, tell me about caches."},
        {"role": "assistant", "content": "Caches keep results so they are not computed again."},
        {"role": "user", "content": "And prefix caches?"},
    ])),
    ("exactly-3-blocks", PromptInput(token_ids=list(range(3 * BLOCK)))),
    ("over-4-blocks", PromptInput(token_ids=[(7 * i) % 400 for i in range(5 * BLOCK + 3)])),
    ("shorter-than-a-block-ids", PromptInput(token_ids=[(11 * i) % 400 for i in range(BLOCK - 1)])),
    ("one-letter-repeated", PromptInput(prompt="a" * 40)),
    ("crlf-lines", PromptInput(prompt="Line one\r\nLine two\r\n" * 5)),
    ("chat-with-numbers", PromptInput(messages=[
        {"role": "user", "content": "Count: " + " ".join(map(str, range(40)))}])),
]
PROMPT_IDS = [name for name, _ in PARITY_PROMPTS]
PROMPTS = [prompt for _, prompt in PARITY_PROMPTS]
PROMPT_BY_ID = dict(PARITY_PROMPTS)
MAX_TOKENS = 12


def cache_config(root: Path, **overrides: object) -> CacheConfig:
    """Device, host and disk tiers under ``root`` (budgets far above what a test stores)."""
    fields: dict[str, object] = {
        "block_tokens": BLOCK,
        "device_bytes": 64 << 20,
        "host_bytes": 64 << 20,
        "disk_bytes": 256 << 20,
        "disk_path": root / "disk",
        # What a tier serves is under test here, not whether loading beats recomputing (a
        # tiny model recomputes faster than loopback Redis answers): always load.
        "skip_slow_tiers": False,
    }
    fields.update(overrides)
    return CacheConfig(**fields)  # type: ignore[arg-type]


def make_engine(tiny: LoadedModel, opened: OpenedCache | None, *, pool: PagePool | None = None,
                **overrides: object) -> Engine:
    """An engine over ``opened`` (its pool, unless ``pool`` names another), started."""
    config = EngineConfig(block_tokens=BLOCK, **overrides)  # type: ignore[arg-type]
    engine = Engine(loaded=tiny, cache=opened.cache if opened else None, config=config,
                    deployment_secret=SECRET,
                    pool=pool if pool is not None else opened.pool if opened else None)
    engine.start()
    assert engine.route.name == config.route or config.route == "auto", engine.route
    assert engine.route.name == "batched" or config.route == "serial", (
        f"the tiny Llama should pass the invariance probe here: {engine.route.reason}")
    return engine


def run(engine: Engine, prompt: PromptInput, *, scope: Scope = ALICE, no_cache: bool = False,
        max_tokens: int = MAX_TOKENS, **sampling: object) -> tuple[list[int], str, Usage]:
    """One greedy (unless ``sampling`` says otherwise) generation: token ids, text, usage."""
    handle = engine.generate(GenerateRequest(
        prompt=prompt, scope=scope,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        cache=CacheOptions(no_cache=no_cache)))
    ids: list[int] = []
    text = ""
    usage = None
    for event in handle:
        if isinstance(event, TokenDelta):
            ids.extend(event.token_ids)
            text += event.text
        else:
            usage = event
    assert usage is not None
    return ids, text, usage


def prompt_tokens(tiny: LoadedModel, prompt: PromptInput) -> list[int]:
    """The canonical token ids of ``prompt`` (what the engine fingerprints and prefills)."""
    return [int(t) for t in canonicalize(prompt, tiny.tokenizer).token_ids]


def num_servable_tokens(num_prompt_tokens: int) -> int:
    """Tokens a warm request is served from the cache: every full block before the one holding
    the last prompt token (that block is recomputed for its logits)."""
    return (num_prompt_tokens - 1) // BLOCK * BLOCK


def load_tiny_as_served(model_dir: str, device: str) -> LoadedModel:
    """The tiny Llama on ``device`` in the dtype ``kvgate serve`` computes in there by default
    (``--dtype auto``: float32 on the CPU, bfloat16 on CUDA, where float32 products of a row
    change with the row count and the probe sends float32 to the serial route)."""
    return load_model(model_dir, device=device,
                      dtype=resolve_dtype("auto", torch.device(device)), block_tokens=BLOCK)


def model_device(loaded: LoadedModel) -> torch.device:
    """Where the model runs (the device tier lives there too)."""
    return next(loaded.model.parameters()).device


_VERDICTS: dict[int, RouteVerdict] = {}
"""The route search's verdict per model (by ``id`` of its module, dropped with it): a search
probes invariance with dozens of forwards (~17 s on SmolLM2), and the oracle is asked for many
prompts of one model."""


def _default_verdict(loaded: LoadedModel) -> RouteVerdict:
    key = id(loaded.model)
    if key not in _VERDICTS:
        _VERDICTS[key] = search_route(loaded, EngineConfig().search_settings())
        weakref.finalize(loaded.model, _VERDICTS.pop, key, None)
    return _VERDICTS[key]


def engine_forward(loaded: LoadedModel, device: torch.device) -> BatchedForward:
    """The batched forward an engine with the default configuration chooses on ``device``: the
    first candidate of this machine's search that the start-up probe passes."""
    del device  # the model's own
    verdict = _default_verdict(loaded)
    forward = build_forward(loaded, verdict)
    assert isinstance(forward, BatchedForward), verdict.reason
    return forward


def cold_blocks(loaded: LoadedModel, tokens: list[int], num_blocks: int, *,
                block_tokens: int = BLOCK, route: str = "batched") -> list[KVBlock]:
    """K/V of the first ``num_blocks`` blocks computed cold, with no cache: the oracle.

    On the batched route one one-shot prefill (its forward gives a block the same K/V however
    it is chunked; ``Engine.cold_blocks`` is the same computation in a running engine); on the
    serial route a block-aligned prefill through transformers.
    """
    n = num_blocks * block_tokens
    device = model_device(loaded)
    if route == "serial":
        computed = compute_block_kv(loaded, torch.tensor(tokens[:n], device=device), block_tokens)
        return [KVBlock(keys=keys, values=values) for keys, values in computed]
    # Pages of a block each, as the engine's: a recurrent layer's state is kept at their ends.
    seq = KVSequence.alone(loaded.layout, max(1, n), page_tokens=block_tokens, device=device)
    forward = engine_forward(loaded, torch.device(device))
    if n:
        forward.forward([SequenceRows(sequence=seq, tokens=torch.tensor(tokens[:n]),
                                      wants_logits=False)])
    return [seq.block(i, block_tokens) for i in range(num_blocks)]


def assert_blocks_equal(served: list[KVBlock], cold: list[KVBlock]) -> None:
    """Bit for bit: every layer's K and V of every block, same dtype and shape."""
    assert len(served) == len(cold)
    for i, (a, b) in enumerate(zip(served, cold, strict=True)):
        assert a.num_layers == b.num_layers
        for layer in range(a.num_layers):
            for kind, x, y in (("K", a.keys[layer], b.keys[layer]),
                               ("V", a.values[layer], b.values[layer])):
                assert x.dtype == y.dtype and x.shape == y.shape, (i, layer, kind)
                # NOTE: on the CPU: a block served from disk or Redis is decoded there, the cold
                # oracle is computed where the model runs (the bits are what is compared).
                assert torch.equal(x.cpu(), y.cpu()), (
                    f"block {i} layer {layer} {kind} differs from cold")


@dataclass
class Served:
    """What one ``load`` handed a request."""

    tiers_before: list[tuple[str, ...]]  # per locally matched block: the tiers holding it
    tiers: tuple[str, ...]  # per served block: the tier it was served from
    blocks: list[KVBlock] = field(default_factory=list)


class ServedSpy:
    """Records every ``cache.load`` of one ``PrefixCache`` instance (install, then run)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.calls: list[Served] = []
        self._cache = cache
        self._load = cache.load

    def install(self, monkeypatch: pytest.MonkeyPatch) -> ServedSpy:
        monkeypatch.setattr(self._cache, "load", self._spy)
        return self

    def _spy(self, lease: Lease, **kwargs: Any) -> list[KVBlock]:
        before = [self._cache.tiers_of(key) for key in lease.match.keys]
        blocks = self._load(lease, **kwargs)
        self.calls.append(Served(
            tiers_before=before, tiers=lease.match.tiers,
            blocks=[KVBlock(keys=tuple(t.clone() for t in b.keys),
                            values=tuple(t.clone() for t in b.values)) for b in blocks]))
        return blocks

    @property
    def only(self) -> Served:
        assert len(self.calls) == 1, f"expected one load, saw {len(self.calls)}"
        return self.calls[0]


def evict_once_released(opened: OpenedCache, *tiers: str) -> None:
    """Evict every block of ``tiers`` once the answer just given lets go of its blocks: a block
    still held (a request's last step, a queued write) stays in an eviction."""
    deadline = time.monotonic() + 10
    while opened.cache.total_refcount() and time.monotonic() < deadline:
        time.sleep(0.01)
    for tier in tiers:
        opened.cache.evict(tier, 10**12)


def assert_served_equals_cold(loaded: LoadedModel, engine: Engine, opened: OpenedCache,
                              monkeypatch: pytest.MonkeyPatch, prompt: PromptInput,
                              cold: tuple[list[int], str], tier: str) -> None:
    """A warm answer of the token prompt ``prompt`` from ``tier`` alone equals the cold one
    ``cold``, tokens and K/V (or latents) of every block served."""
    tokens = list(prompt.token_ids or [])
    num_blocks = num_servable_tokens(len(tokens)) // BLOCK
    spy = ServedSpy(opened.cache).install(monkeypatch)
    ids, text, usage = run(engine, prompt)
    assert (ids, text) == cold
    assert usage.cached_tokens_by_tier == {tier: num_blocks * BLOCK}
    assert_blocks_equal(spy.only.blocks, cold_blocks(loaded, tokens, num_blocks))


def assert_served_from_redis_by_another_engine_equals_cold(
        loaded: LoadedModel, redis_url: str, root: Path, monkeypatch: pytest.MonkeyPatch,
        prompt: PromptInput) -> None:
    """One engine answers ``prompt`` cold and warm (writing its blocks to the Redis at
    ``redis_url``), stops; a second engine, its own tiers over the same Redis, answers it warm
    from Redis alone: the cold answer, tokens and K/V of every block served."""
    from gateway.cache.operations.factory import open_cache

    def tiers(name: str) -> OpenedCache:
        return open_cache(cache_config(root / name, disk_bytes=0, disk_path=None,
                                       redis_url=redis_url),
                          layout=loaded.layout, deployment_secret=SECRET)

    writer_tiers = tiers("writer")
    writer = make_engine(loaded, writer_tiers)
    try:
        cold = run(writer, prompt, no_cache=True)[:2]
        assert run(writer, prompt)[:2] == cold
    finally:
        writer.stop(grace_s=5)
        writer_tiers.close()  # its queued Redis writes land first
    reader_tiers = tiers("reader")
    reader = make_engine(loaded, reader_tiers)
    try:
        assert_served_equals_cold(loaded, reader, reader_tiers, monkeypatch, prompt, cold,
                                  "redis")
    finally:
        reader.stop(grace_s=5)
        reader_tiers.close()
