"""kvgate's connector inside a real vLLM (its CPU build, ``make test-vllm``): a tiny random Llama
served by an eager ``vllm.LLM`` in float32, greedy, each life a process of its own
(gateway/vllm_connector/, docs/vllm-worker.md)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.cache.operations.admin import CacheAdmin
from gateway.cache.operations.invalidation import EventBounds, EvictionFeed
from gateway.core.fingerprint import Scope
from gateway.vllm_connector.deployment import ConnectorDeployment, ConnectorSettings
from gateway.vllm_connector.page_layout import VllmPageLayout
from gateway.vllm_connector.scope_tag import TAG_PARAM, scope_key, sign
from gateway.vllm_connector.worker_admin import WorkerPromptKeys
from tests.redis_harness import RedisServer, free_port
from tests.tiny_llama import save_tiny_llama
from tests.vllm_worker.harness import (
    SECRET_HEX,
    Answer,
    api_server,
    complete,
    failed_life,
    live,
    vllm_python,
    write_worker_config,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(vllm_python() is None,
                       reason="make test-vllm runs these (vLLM's CPU build, in its own venv)"),
]

BLOCK = 32
PROMPT = list(range(5, 205))  # 200 tokens: six whole blocks before the last token
LOADABLE = 6 * BLOCK


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # vLLM's CPU attention takes heads of 32 and up: hidden 128 over 4 heads
    return str(save_tiny_llama(tmp_path_factory.mktemp("tiny"), hidden=128))


def job(model: str, requests: list[dict[str, Any]], config: Path | None = None,
        **options: Any) -> dict[str, Any]:
    return {"model": model, "block_size": BLOCK, "requests": requests,
            "kvgate_config": str(config) if config is not None else None, **options}


@pytest.fixture(scope="module")
def cold(model: str) -> list[int]:
    """The prompt's answer from vLLM without the connector."""
    (answer,) = live(job(model, [{"tokens": PROMPT}]))
    return answer.tokens


def as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def signed(scope: Scope) -> dict[str, str]:
    key = scope_key(bytes.fromhex(SECRET_HEX))
    return sign(scope, key, expires_at_ms=int(time.time() * 1000) + 600_000)


def test_a_restarted_vllm_loads_the_prompt_from_kvgates_disk_and_answers_the_same(
        model: str, cold: list[int], tmp_path: Path) -> None:
    config = write_worker_config(tmp_path, block_tokens=BLOCK)
    first, again = live(job(model, [{"tokens": PROMPT}] * 2, config, default_scope="shared"))
    (restarted,) = live(job(model, [{"tokens": PROMPT}], config, default_scope="shared"))
    assert (first.loaded_tokens, again.loaded_tokens, restarted.loaded_tokens) == (
        0, LOADABLE, LOADABLE)
    assert restarted.cached == LOADABLE  # vLLM counts them as cached prompt tokens
    assert first.tokens == again.tokens == restarted.tokens == cold


def test_a_flipped_bit_on_disk_is_recomputed_and_counted(
        model: str, cold: list[int], tmp_path: Path) -> None:
    config = write_worker_config(tmp_path, block_tokens=BLOCK)
    live(job(model, [{"tokens": PROMPT}], config, default_scope="shared"))
    files = sorted((tmp_path / "kv").rglob("*.kvb"))
    assert len(files) == 6
    victim = random.Random(0).choice(files)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    (answer,) = live(job(model, [{"tokens": PROMPT}], config, default_scope="shared"))
    assert answer.failed_blocks >= 1
    assert answer.loaded_tokens < LOADABLE
    assert answer.tokens == cold


def test_tenants_get_no_hits_on_each_others_blocks_and_a_forged_tag_gets_the_default(
        model: str, cold: list[int], tmp_path: Path) -> None:
    config = write_worker_config(tmp_path, block_tokens=BLOCK)
    tenant_a, tenant_b = signed(Scope.of_tenant("a")), signed(Scope.of_tenant("b"))
    forged = {**tenant_a, TAG_PARAM: "00" * 32}
    answers: list[Answer] = live(job(model, [
        {"tokens": PROMPT, "params": tenant_a},
        {"tokens": PROMPT, "params": tenant_b},
        {"tokens": PROMPT, "params": tenant_a},
        {"tokens": PROMPT, "params": forged},
        {"tokens": PROMPT},
    ], config, default_scope="none"))
    assert [a.loaded_tokens for a in answers] == [0, 0, LOADABLE, 0, 0]
    assert [(a.connector or {}).get("kvgate.scope_refused") for a in answers] == [
        None, None, None, "tag", None]  # counted; an unsigned request is not a forgery
    assert all(a.tokens == cold for a in answers)


def test_a_second_vllm_server_loads_what_the_first_stored_in_redis_and_refuses_a_flipped_bit(
        model: str, cold: list[int], tmp_path: Path, redis_server: RedisServer) -> None:
    redis_tier = f'\n[[cache.tier]]\nkind = "redis"\nurl = "{redis_server.url}"\n'

    def server(name: str) -> Path:
        return write_worker_config(tmp_path / name, block_tokens=BLOCK, extra_tiers=redis_tier)

    (stored,) = live(job(model, [{"tokens": PROMPT}], server("first"), default_scope="shared"))
    (loaded,) = live(job(model, [{"tokens": PROMPT}], server("second"), default_scope="shared"))
    client = redis_server.client()
    values = sorted(as_bytes(key) for key in client.keys("kvgate:*"))
    values = [key for key in values if not key.endswith(b":events")]
    assert len(values) == 6
    victim = values[2]
    middle = client.strlen(victim) // 2
    byte = as_bytes(client.getrange(victim, middle, middle))
    client.setrange(victim, middle, bytes([byte[0] ^ 0x10]))
    (refused,) = live(job(model, [{"tokens": PROMPT}], server("third"), default_scope="shared"))
    assert (stored.loaded_tokens, loaded.loaded_tokens) == (0, LOADABLE)
    assert refused.failed_blocks >= 1 and refused.loaded_tokens < LOADABLE
    assert stored.tokens == loaded.tokens == refused.tokens == cold


def test_vllms_own_prefix_cache_is_refused_behind_the_connector(
        model: str, tmp_path: Path) -> None:
    config = write_worker_config(tmp_path, block_tokens=BLOCK)
    output = failed_life(job(model, [{"tokens": PROMPT}], config, prefix_caching=True))
    assert "start vLLM with --no-enable-prefix-caching" in output


def test_an_operators_eviction_published_while_vllm_was_down_makes_it_miss(
        model: str, cold: list[int], tmp_path: Path, redis_server: RedisServer) -> None:
    redis_tier = f'\n[[cache.tier]]\nkind = "redis"\nurl = "{redis_server.url}"\n'
    config = write_worker_config(tmp_path / "worker", block_tokens=BLOCK, extra_tiers=redis_tier)
    tenant_a = signed(Scope.of_tenant("a"))
    (stored,) = live(job(model, [{"tokens": PROMPT, "params": tenant_a}], config))
    evict_tenant_through_another_replica("a", tmp_path / "gateway", redis_tier)
    # its disk and Redis still hold the blocks; the stream says they are evicted
    (restarted,) = live(job(model, [{"tokens": PROMPT, "params": tenant_a}], config))
    assert (stored.loaded_tokens, restarted.loaded_tokens) == (0, 0)
    assert restarted.failed_blocks == 0  # not promised: a clean miss
    assert stored.tokens == restarted.tokens == cold


def test_a_tenant_over_its_quota_gets_only_what_fits(
        model: str, cold: list[int], tmp_path: Path) -> None:
    # a block here is 2 layers x K and V x 2 heads x 32 tokens x 32 x 4 bytes = 32 KiB
    config = write_worker_config(
        tmp_path, block_tokens=BLOCK,
        extra_cache='tenant_quota = { device = "64KiB", disk = "64KiB" }')
    tenant_a = signed(Scope.of_tenant("a"))
    answers = live(job(model, [{"tokens": PROMPT, "params": tenant_a}] * 2, config))
    assert [a.loaded_tokens for a in answers] == [0, 2 * BLOCK]
    assert all(a.tokens == cold for a in answers)


def evict_tenant_through_another_replica(tenant: str, directory: Path, redis_tier: str) -> None:
    """``kvgate admin evict --tenant`` as another replica runs it: evicted there and in Redis,
    and published on the stream every replica follows. The replica's namespaces are not the
    vLLM worker's (its own engine's page layout)."""
    publisher = ConnectorDeployment.open(
        ConnectorSettings(config_path=write_worker_config(directory, block_tokens=BLOCK,
                                                          extra_tiers=redis_tier),
                          default_scope=None, model_fingerprint="kvgate's own engine"),
        VllmPageLayout(vllm_version="-", backend="kvgate", isa="-", dtype=torch.float32,
                       block_size=BLOCK, num_layers=2, kv_heads=2, head_size=32),
        model="unused", env={"KVGATE_DEPLOYMENT_SECRET": SECRET_HEX})
    opened = publisher.open_cache(running_pages=4)
    try:
        assert opened.events is not None
        feed = EvictionFeed(opened.events, lambda event: None, origin="gateway",
                            bounds=EventBounds(max_prefix_chars=1000, max_tenant_chars=128))
        CacheAdmin(opened.cache, keys=WorkerPromptKeys(publisher, None),
                   feed=feed).evict(tenant=tenant)
    finally:
        opened.close()


def test_vllms_openai_server_carries_the_gateways_scope_to_the_connector(
        model: str, tmp_path: Path) -> None:
    config = write_worker_config(tmp_path, block_tokens=BLOCK)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
            "kv_transfer_params": signed(Scope.of_tenant("a"))}
    with api_server(model, config, port=free_port(), block_size=BLOCK) as base:
        first, second = complete(base, body), complete(base, body)
        unsigned = complete(base, {**body, "kv_transfer_params": None})
    loaded = [(answer["kv_transfer_params"] or {}).get("kvgate.loaded_tokens", 0)
              for answer in (first, second, unsigned)]
    assert loaded == [0, LOADABLE, 0]  # the unsigned request gets the default scope: none
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert TAG_PARAM not in first["kv_transfer_params"]  # the tag never goes back


def test_a_conversations_next_turn_loads_the_previous_answer_too(
        model: str, tmp_path: Path) -> None:
    config = write_worker_config(tmp_path, block_tokens=BLOCK)
    first, second = live(job(model, [{"tokens": PROMPT}, {"after_previous": [7] * 10}], config,
                             default_scope="shared", max_tokens=60, ignore_eos=True))
    # 200 prompt tokens and 59 answered ones have K/V (the last answered token never ran):
    # eight whole blocks, against six of the prompt alone
    assert second.loaded_tokens == 8 * BLOCK
    (alone,) = live(job(model, [{"tokens": second.prompt}], max_tokens=60, ignore_eos=True))
    assert second.tokens == alone.tokens  # the answer vLLM gives that prompt without kvgate
