"""KV events from a real request: the tiny Llama's engine over a cache opened as ``serve`` opens
it (device, host and disk tiers), its blocks published to a router's SUB socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from gateway.cache.operations.factory import open_cache
from gateway.core.canonical import PromptInput
from gateway.core.tokens import as_token_ids
from gateway.engine.models.loading import LoadedModel, load_model
from gateway.service.kv_events.publisher import KVEventPublisher
from tests.gateway.engine.parity import BLOCK, SECRET, cache_config, make_engine, run
from tests.gateway.service.kv_events_router import TOPIC, BlockStored, Subscriber, wire_hash
from tests.tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")))


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher(endpoint="tcp://127.0.0.1:0", topic=TOPIC)
    pub.start()
    yield pub
    pub.close()


def test_a_cold_request_publishes_its_prompt_blocks_in_order_on_the_gpu_medium(
        tiny: LoadedModel, tmp_path: Path, publisher: KVEventPublisher) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = Subscriber(context, publisher)
    opened = open_cache(cache_config(tmp_path), layout=tiny.layout, deployment_secret=SECRET,
                        tier_events=publisher)
    engine = make_engine(tiny, opened)
    try:
        prompt = [(7 * i) % 400 for i in range(3 * BLOCK + 5)]
        run(engine, PromptInput(token_ids=prompt), max_tokens=2)
        blocks: list[BlockStored] = []
        while len(blocks) < 3:
            blocks.extend(e for e in sub.receive()[1].events if isinstance(e, BlockStored))
        (namespace,) = opened.cache.known_namespaces()
        keys = opened.cache.lookup(namespace, as_token_ids(prompt)).keys
    finally:
        engine.stop(grace_s=5)
        opened.close()
        sub.sock.close(linger=0)
        context.destroy(linger=0)
    first = blocks[:3]
    assert [e.token_ids for e in first] == [prompt[i * BLOCK:(i + 1) * BLOCK] for i in range(3)]
    assert {e.medium for e in blocks} == {"GPU"}  # the disk tier's write-through is not said
    assert [e.block_hashes for e in first] == [[wire_hash(k)] for k in keys[:3]]
    assert [e.parent_block_hash for e in first] == [None, wire_hash(keys[0]),
                                                     wire_hash(keys[1])]
