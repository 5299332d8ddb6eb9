"""A forged block in Redis or on disk is never served: Generate over it returns the cold answer.

The forgery is the one format 1 of the codec accepted (``tests/tiers/xxh3_forgery.py``): the
header is left as written, the payload is replaced by KV of the attacker's choosing with two
words per lane in each KiB solved so that its xxh3-128 is unchanged. The block MAC over header
and payload refuses it; the gateway counts the reason, drops the block and recomputes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cache.operations.factory import open_cache
from gateway.core.admin_reports import StoreReport
from gateway.engine.models.loading import LoadedModel, load_model
from tests.gateway.engine.parity import PROMPTS, SECRET, cache_config, make_engine, run
from tests.redis_harness import RedisServer
from tests.tiers.xxh3_forgery import forge_keeping_xxh3
from tests.tiny_llama import save_tiny_llama
from tiers.codec import BlockCodec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


def forged(blob: bytes) -> bytes:
    """``blob`` with its header kept and its payload forged to keep its xxh3-128."""
    header_len = BlockCodec.header_length(blob)
    payload, _ = forge_keeping_xxh3(blob[header_len:], b"\x7f" * (len(blob) - header_len))
    return blob[:header_len] + payload


def failures(all_stats: list[StoreReport], tier: str) -> dict[str, int]:
    [stats] = [s for s in all_stats if s.name == tier]
    return stats.verification_failures


@pytest.mark.redis
def test_generate_over_forged_redis_values_returns_the_cold_answer(
    tiny: LoadedModel, tmp_path: Path, redis_server: RedisServer
) -> None:
    prompt = PROMPTS[3]
    writer = open_cache(cache_config(tmp_path / "a", redis_url=redis_server.url, disk_bytes=0),
                        layout=tiny.layout, deployment_secret=SECRET)
    reader = open_cache(cache_config(tmp_path / "b", redis_url=redis_server.url, disk_bytes=0),
                        layout=tiny.layout, deployment_secret=SECRET)
    a, b = make_engine(tiny, writer), make_engine(tiny, reader)
    try:
        cold, _, _ = run(b, prompt, no_cache=True)
        run(a, prompt)
        assert writer.hierarchy.flush(timeout_s=10)
        keys = redis_server.command("KEYS", "*")
        assert isinstance(keys, list) and keys  # positive control: the blocks reached Redis
        for key in keys:
            value = redis_server.command("GET", key)
            assert isinstance(value, bytes)
            redis_server.command("SET", key, forged(value))
        warm, _, usage = run(b, prompt)
        assert warm == cold
        assert usage.cached_tokens_by_tier.get("redis", 0) == 0
        assert failures(reader.hierarchy.stats(), "redis").get("payload_mac", 0) >= 1
    finally:
        a.stop()
        b.stop()
        writer.close()
        reader.close()


def test_generate_over_forged_disk_files_after_a_restart_returns_the_cold_answer(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    prompt = PROMPTS[1]
    first = open_cache(cache_config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    engine = make_engine(tiny, first)
    cold, _, _ = run(engine, prompt, no_cache=True)
    run(engine, prompt)
    engine.stop()
    first.close()
    files = sorted((tmp_path / "disk").rglob("*.kvb"))
    assert files  # positive control: the blocks reached the disk
    for path in files:
        path.write_bytes(forged(path.read_bytes()))
    second = open_cache(cache_config(tmp_path), layout=tiny.layout, deployment_secret=SECRET)
    assert second.num_recovered_blocks == len(files)  # the headers are genuine: adopted
    engine = make_engine(tiny, second)
    try:
        warm, _, usage = run(engine, prompt)
        assert warm == cold
        assert usage.cached_tokens_by_tier.get("disk", 0) == 0
        assert failures(second.hierarchy.stats(), "disk").get("payload_mac", 0) >= 1
    finally:
        engine.stop()
        second.close()
