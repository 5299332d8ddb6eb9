"""Lossy lower tiers through the engine: a request that allows lossy copies reads them (and says
so), an exact request never does, and nothing computed on a lossy prefix reaches an exact tier.

The tiny Llama on 16-token blocks over device, host (exact), disk (int8) and, where named, a real
Redis (int8). Evicting the device and host tiers leaves only the lossy copies the inserts wrote
through to the disk (docs/design.md, "Lossy tiers").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from gateway.cache.base import TierEvents
from gateway.cache.operations.admin import evict_where
from gateway.cache.operations.factory import OpenedCache, open_cache
from gateway.cache.operations.session_admin import drop_session
from gateway.core.canonical import PromptInput
from gateway.core.errors import IndexInvariantError
from gateway.core.requests import (
    CacheOptions,
    GenerateRequest,
    LookupRequest,
    SamplingParams,
    TokenDelta,
    Usage,
)
from gateway.core.tokens import as_token_ids
from gateway.engine.engine import Engine
from gateway.engine.models.loading import LoadedModel
from policies.base import BlockKey
from tests.gateway.engine.parity import ALICE, BLOCK, SECRET, cache_config, make_engine
from tests.redis_harness import RedisServer
from tiers.base import BlockMeta

PROMPT = [(5 * i + 3) % 400 for i in range(5 * BLOCK + 7)]
"""Five full blocks and a partial one holding the last prompt token: a warm request is served
all five full blocks."""
MAX_TOKENS = 10


def generate(engine: Engine, tokens: list[int], *, allow_lossy: bool = False,
             no_cache: bool = False, session: str | None = None, tag: str | None = None,
             max_tokens: int = MAX_TOKENS) -> tuple[list[int], Usage]:
    ids: list[int] = []
    usage = None
    for event in engine.generate(GenerateRequest(
            prompt=PromptInput(token_ids=tokens), scope=ALICE,
            sampling=SamplingParams(max_tokens=max_tokens),
            cache=CacheOptions(allow_lossy=allow_lossy, no_cache=no_cache,
                               session_id=session, tag=tag))):
        if isinstance(event, TokenDelta):
            ids.extend(event.token_ids)
        else:
            usage = event
    assert usage is not None
    return ids, usage


def drop_exact_copies(opened: OpenedCache) -> None:
    """Evict everything from the device and host tiers: exact blocks demote into the exact host
    tier, then out of it (the disk below is lossy: nothing exact goes there); lossy pages on
    the device demote into the disk."""
    cache = opened.cache
    cache.evict("device", 1 << 40)
    cache.evict("host", 1 << 40)
    opened.hierarchy.flush(timeout_s=30.0)


@contextmanager
def serving(tiny: LoadedModel, root: Path, *, tier_events: TierEvents | None = None,
            **overrides: object) -> Iterator[tuple[Engine, OpenedCache]]:
    """An engine over the tiers of ``cache_config(root, **overrides)``, stopped (and its cache
    closed) when the block ends."""
    opened = open_cache(cache_config(root, **overrides), layout=tiny.layout,
                        deployment_secret=SECRET, tier_events=tier_events)
    try:
        engine = make_engine(tiny, opened)
        try:
            yield engine, opened
        finally:
            engine.stop(grace_s=5)
    finally:
        opened.close()


@pytest.fixture
def lossy_disk(tiny: LoadedModel, tmp_path: Path) -> Iterator[tuple[Engine, OpenedCache]]:
    with serving(tiny, tmp_path, quantize={"disk": "int8"}) as stack:
        yield stack


def disk_namespaces(opened: OpenedCache) -> set[str | None]:
    """The quantization of every namespace the disk tier holds a block of."""
    placement = opened.cache.placement
    with placement.locked():
        return {r.namespace.quantization for r in placement.index.records()
                if placement.holds(r, "disk")}


def test_an_allowing_request_reads_the_lossy_copies_and_says_so(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    generate(engine, PROMPT)
    drop_exact_copies(opened)
    _, usage = generate(engine, PROMPT, allow_lossy=True)
    assert usage.lossy
    assert usage.cached_tokens_by_tier == {"disk:int8": 5 * BLOCK}


def test_an_exact_request_never_reads_a_lossy_copy(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    cold, _ = generate(engine, PROMPT, no_cache=True)
    generate(engine, PROMPT)
    drop_exact_copies(opened)
    generate(engine, PROMPT, allow_lossy=True)  # lossy pages on the device now, too
    ids, usage = generate(engine, PROMPT)
    assert not usage.lossy
    assert usage.cached_tokens == 0
    assert ids == cold


def test_an_exact_hit_is_preferred_to_a_lossy_copy(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, _ = lossy_disk
    cold, _ = generate(engine, PROMPT, no_cache=True)
    generate(engine, PROMPT)
    ids, usage = generate(engine, PROMPT, allow_lossy=True)
    assert not usage.lossy
    assert usage.cached_tokens_by_tier == {"device": 5 * BLOCK}
    assert ids == cold


def test_the_lossy_tier_holds_lossy_blocks_only(lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    generate(engine, PROMPT)
    generate(engine, PROMPT[:3 * BLOCK] + [7] * 40, allow_lossy=True)
    drop_exact_copies(opened)
    assert disk_namespaces(opened) == {"int8"}


def test_what_a_lossy_request_computes_is_stored_lossy_and_served_alike(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    generate(engine, PROMPT[:2 * BLOCK])
    drop_exact_copies(opened)
    first, usage = generate(engine, PROMPT, allow_lossy=True)
    assert usage.cached_tokens_by_tier == {"disk:int8": 2 * BLOCK}
    # Its own blocks 2..4 went to the device under lossy keys (never under exact ones).
    again, usage = generate(engine, PROMPT, allow_lossy=True)
    assert usage.lossy
    assert sum(usage.cached_tokens_by_tier.values()) == 5 * BLOCK
    assert set(usage.cached_tokens_by_tier) <= {"device:int8", "disk:int8"}
    assert again == first
    _, exact = generate(engine, PROMPT)
    assert exact.cached_tokens == 0 and not exact.lossy


def test_lossy_copies_are_served_again_after_a_restart(tiny: LoadedModel,
                                                       tmp_path: Path) -> None:
    with serving(tiny, tmp_path, quantize={"disk": "int8"}) as (engine, _):
        generate(engine, PROMPT)
    with serving(tiny, tmp_path, quantize={"disk": "int8"}) as (engine, opened):
        # The prompt's five blocks and the one its answer filled (87 + 10 tokens, 96 computed).
        assert opened.num_recovered_blocks == 6
        assert disk_namespaces(opened) == {"int8"}
        _, usage = generate(engine, PROMPT, allow_lossy=True)
        assert usage.cached_tokens_by_tier == {"disk:int8": 5 * BLOCK} and usage.lossy
        _, usage = generate(engine, PROMPT)
        assert usage.cached_tokens == 0 and not usage.lossy


def test_a_lossy_redis_serves_another_replica_only_what_was_asked_for(
        tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer) -> None:
    with ExitStack() as stack:
        (first, first_cache), (second, _) = (
            stack.enter_context(serving(tiny, tmp_path / name, disk_bytes=0, disk_path=None,
                                        redis_url=redis_server.url, remote_write=True,
                                        quantize={"redis": "int8"}))
            for name in ("a", "b"))
        generate(first, PROMPT)
        first_cache.hierarchy.flush(timeout_s=30.0)
        _, usage = generate(second, PROMPT, allow_lossy=True)
        assert usage.cached_tokens_by_tier == {"redis:int8": 5 * BLOCK} and usage.lossy
        _, usage = generate(second, PROMPT)
        assert usage.cached_tokens == 0 and not usage.lossy


def test_a_lossy_host_tier_keeps_its_copies_quantized_and_serves_them(
        tiny: LoadedModel, tmp_path: Path) -> None:
    with serving(tiny, tmp_path, quantize={"host": "int8", "disk": "int8"}) as (engine, opened):
        generate(engine, PROMPT)
        opened.cache.evict("device", 1 << 40)  # exact blocks: no exact tier below, dropped
        host = opened.hierarchy.store("host").stats()
        assert host.notes["quantization"] == "int8"
        _, usage = generate(engine, PROMPT, allow_lossy=True)
        assert usage.cached_tokens_by_tier == {"host:int8": 5 * BLOCK} and usage.lossy


def test_a_session_reset_drops_the_lossy_copies_of_its_blocks(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    generate(engine, PROMPT, session="chat-1")
    drop_session(opened.cache, ALICE.owner, "chat-1")
    drop_exact_copies(opened)
    assert disk_namespaces(opened) == set()
    _, usage = generate(engine, PROMPT, allow_lossy=True)
    assert usage.cached_tokens == 0 and not usage.lossy


def test_evicting_a_tag_drops_the_lossy_copies_of_its_blocks(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    generate(engine, PROMPT, tag="docs-v3")
    evict_where(opened.cache, tag="docs-v3")
    opened.hierarchy.flush(timeout_s=30.0)
    _, usage = generate(engine, PROMPT, allow_lossy=True)
    assert usage.cached_tokens == 0 and not usage.lossy


@pytest.mark.parametrize(("before", "after"), [({}, {"disk": "int8"}), ({"disk": "int8"}, {})])
def test_turning_a_tiers_format_on_or_off_drops_its_blocks_at_the_next_start(
        tiny: LoadedModel, tmp_path: Path, before: dict[str, str],
        after: dict[str, str]) -> None:
    with serving(tiny, tmp_path, quantize=before) as (engine, _):
        generate(engine, PROMPT)
    opened = open_cache(cache_config(tmp_path, quantize=after), layout=tiny.layout,
                        deployment_secret=SECRET)
    try:
        assert opened.num_recovered_blocks == 0
    finally:
        opened.close()


def test_lossy_copies_are_not_announced_to_routers(tiny: LoadedModel, tmp_path: Path) -> None:
    announced: list[tuple[bytes, str]] = []

    class Listener:
        def stored(self, meta: BlockMeta, tier: str) -> None:
            announced.append((meta.namespace_digest, tier))

        def removed(self, key: BlockKey, tier: str) -> None:
            pass

        def cleared(self) -> None:
            pass

    with serving(tiny, tmp_path, tier_events=Listener(),
                 quantize={"disk": "int8"}) as (engine, opened):
        generate(engine, PROMPT)
        drop_exact_copies(opened)
        generate(engine, PROMPT, allow_lossy=True)  # lossy pages on the device now
        exact = engine.namespace(ALICE).digest
        assert announced and {digest for digest, _ in announced} == {exact}


def test_a_block_dequantized_from_a_lossy_copy_is_never_inserted_as_exact(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    generate(engine, PROMPT)
    drop_exact_copies(opened)
    cache = opened.cache
    tokens = as_token_ids(PROMPT)
    lossy = cache.lossy_namespace(engine.namespace(ALICE))
    assert lossy is not None
    with cache.acquire(lossy, tokens) as lease, cache.placement.locked():
        metas = [cache.placement.meta(record) for record in lease.records]
    disk = opened.hierarchy.store("disk")
    marked = [block for meta in metas if (block := disk.get(meta)) is not None]
    assert len(marked) == 5 and all(block.quantization == "int8" for block in marked)
    with cache.acquire(engine.namespace(ALICE), tokens) as exact:
        with pytest.raises(IndexInvariantError, match="dequantized from a lossy copy"):
            cache.insert(exact, tier="device", blocks=marked)


def test_an_fp8_tier_serves_its_copies_under_its_own_name(tiny: LoadedModel,
                                                          tmp_path: Path) -> None:
    with serving(tiny, tmp_path, quantize={"disk": "fp8"}) as (engine, opened):
        generate(engine, PROMPT)
        drop_exact_copies(opened)
        _, usage = generate(engine, PROMPT, allow_lossy=True)
        assert usage.cached_tokens_by_tier == {"disk:fp8": 5 * BLOCK} and usage.lossy


def test_a_lookup_that_allows_lossy_copies_counts_them_under_their_format(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    generate(engine, PROMPT[:2 * BLOCK])
    generate(engine, PROMPT)
    opened.cache.evict("device", 1 << 40)  # the exact copies go to the host tier
    opened.cache.evict("host", 1 << 40)  # and then nowhere: the disk below is lossy
    generate(engine, PROMPT[:2 * BLOCK])  # the first two blocks are exact again
    prompt = PromptInput(token_ids=PROMPT)
    exact = engine.lookup(LookupRequest(prompt=prompt, scope=ALICE))
    assert exact.cached_tokens_by_tier == {"device": 2 * BLOCK} and not exact.lossy
    both = engine.lookup(LookupRequest(prompt=prompt, scope=ALICE, allow_lossy=True))
    assert both.lossy
    assert both.cached_tokens_by_tier == {"device": 2 * BLOCK, "disk:int8": 3 * BLOCK}
    assert both.cached_tokens == 5 * BLOCK and both.diverges_at_block is None
    _, usage = generate(engine, PROMPT, allow_lossy=True)  # what a Generate then reads
    assert usage.cached_tokens_by_tier == both.cached_tokens_by_tier


def test_a_lossy_conversation_continues_from_its_lossy_tail(
        lossy_disk: tuple[Engine, OpenedCache]) -> None:
    engine, opened = lossy_disk
    assert engine.route.decode_kv_is_prefill_kv, engine.route.reason  # tails are kept
    generate(engine, PROMPT)
    drop_exact_copies(opened)
    prompt = PROMPT[:5 * BLOCK + 5]
    answer, first = generate(engine, prompt, allow_lossy=True)
    assert first.lossy and len(answer) == MAX_TOKENS
    held = len(prompt) + len(answer) - 1  # 94: five blocks and a 14-token tail
    _, usage = generate(engine, prompt + answer + [3, 4, 5, 6, 7], allow_lossy=True)
    assert usage.lossy
    assert usage.cached_tokens_by_tier == {"device:int8": held}  # its blocks and its tail
