"""The scheduler side's decisions: how much of a prompt vLLM is told it can load, which blocks the
worker loads and saves when (gateway/vllm_connector/planning.py)."""

from __future__ import annotations

import pickle

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.fingerprint import (
    BlockFingerprinter,
    Namespace,
    NamespaceSpec,
    Scope,
    derive_namespace,
)
from gateway.core.tokens import as_token_ids
from gateway.vllm_connector.known_keys import KnownKeys
from gateway.vllm_connector.orders import LoadOutcome, WorkerReport
from gateway.vllm_connector.planning import LoadPlanner, ScheduledNew, ScheduledRunning
from policies.base import BlockKey

BLOCK = 32
SECRET = bytes(range(32))
TENANT_A, TENANT_B = Scope.of_tenant("a"), Scope.of_tenant("b")


def namespace_of(scope: Scope) -> Namespace:
    return derive_namespace(NamespaceSpec(deployment_secret=SECRET, model_fingerprint="m",
                                          kv_dtype="float32", device_kind="vllm-cpu/test",
                                          scope=scope))


def keys_of(scope: Scope, prompt: list[int]) -> list[BlockKey]:
    return list(BlockFingerprinter(namespace_of(scope), BLOCK).block_keys(as_token_ids(prompt)))


def planner(known: KnownKeys | None = None) -> LoadPlanner:
    return LoadPlanner(block_tokens=BLOCK, namespace_of=namespace_of,
                       known=known if known is not None else KnownKeys())


def prompt(num_tokens: int, start: int = 5) -> list[int]:
    return list(range(start, start + num_tokens))


def held(scope: Scope, tokens: list[int], num_blocks: int | None = None) -> KnownKeys:
    known = KnownKeys()
    keys = keys_of(scope, tokens)
    known.remember(keys[:num_blocks] if num_blocks is not None else keys)
    return known


def new(request_id: str, blocks: int, *, computed: int = 0, scheduled: int = 0
        ) -> ScheduledNew:
    return ScheduledNew(request_id=request_id, block_ids=tuple(range(10, 10 + blocks)),
                        num_computed_tokens=computed, num_scheduled_tokens=scheduled)


def test_a_prompt_nobody_cached_loads_nothing() -> None:
    assert planner().match("r", prompt(200), TENANT_A, num_computed_tokens=0) == 0


def test_a_cached_prompt_loads_its_whole_blocks_but_never_its_last_token() -> None:
    tokens = prompt(6 * BLOCK)  # six whole blocks: the sixth holds the last token
    plans = planner(held(TENANT_A, tokens))
    assert plans.match("r", tokens, TENANT_A, num_computed_tokens=0) == 5 * BLOCK


def test_a_load_stops_at_the_first_block_the_worker_lacks() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens, num_blocks=2))
    assert plans.match("r", tokens, TENANT_A, num_computed_tokens=0) == 2 * BLOCK


def test_another_tenants_blocks_are_not_a_hit() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_B, tokens))
    assert plans.match("r", tokens, TENANT_A, num_computed_tokens=0) == 0


def test_a_request_without_a_scope_is_neither_loaded_nor_saved() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens))
    assert plans.match("r", tokens, None, num_computed_tokens=0) == 0
    orders = plans.step([new("r", 7, scheduled=200)], [])
    assert orders.loads == () and orders.saves == ()


def test_only_what_lies_past_vllms_own_hit_is_loaded() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens))
    assert plans.match("r", tokens, TENANT_A, num_computed_tokens=2 * BLOCK) == 4 * BLOCK
    plans.allocated("r", 4 * BLOCK)
    (load,) = plans.step([new("r", 7, computed=6 * BLOCK, scheduled=8)], []).loads
    assert load.first_block == 2 and load.block_ids == (12, 13, 14, 15)
    assert load.tokens == tuple(tokens[:6 * BLOCK])


def test_the_worker_loads_into_the_blocks_vllm_allocated() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens))
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.allocated("r", 6 * BLOCK)
    orders = plans.step([new("r", 7, computed=6 * BLOCK, scheduled=8)], [])
    (load,) = orders.loads
    assert (load.request_id, load.first_block, load.block_ids) == ("r", 0, tuple(range(10, 16)))


def test_a_load_vllm_did_not_take_is_not_ordered() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens))
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.allocated("r", 0)
    assert plans.step([new("r", 7, scheduled=200)], []).loads == ()


def test_blocks_are_saved_by_the_steps_that_compute_them() -> None:
    tokens = prompt(200)
    plans = planner()
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    (first,) = plans.step([new("r", 4, scheduled=128)], []).saves  # a chunked prefill
    assert first.block_ids == (10, 11, 12, 13) and first.tokens == tuple(tokens[:128])
    last = plans.step([], [ScheduledRunning(request_id="r", new_block_ids=(14, 15, 16),
                                            resumed=False, num_computed_tokens=128,
                                            num_scheduled_tokens=72)])
    (save,) = last.saves
    assert save.block_ids == tuple(range(10, 16))  # six whole blocks; the seventh is partial
    assert save.tokens == tuple(tokens[:6 * BLOCK])


def test_a_block_is_saved_once() -> None:
    tokens = prompt(64)
    plans = planner()
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    assert len(plans.step([new("r", 3, scheduled=64)], []).saves) == 1
    decode = ScheduledRunning(request_id="r", new_block_ids=(), resumed=False,
                              num_computed_tokens=64, num_scheduled_tokens=1)
    assert plans.step([], [decode], tokens_of=lambda _: [*tokens, 7]).saves == ()


def test_an_answers_blocks_are_saved_as_they_fill() -> None:
    tokens = prompt(64)
    answer = list(range(300, 332))
    plans = planner()
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.step([new("r", 3, scheduled=64)], [])
    decode = ScheduledRunning(request_id="r", new_block_ids=(), resumed=False,
                              num_computed_tokens=95, num_scheduled_tokens=1)
    (save,) = plans.step([], [decode], tokens_of=lambda _: [*tokens, *answer]).saves
    assert save.tokens == (*tokens, *answer) and save.block_ids == (10, 11, 12)


def test_blocks_whose_token_ids_are_not_known_yet_are_not_saved() -> None:
    tokens = prompt(64)
    plans = planner()
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.step([new("r", 3, scheduled=64)], [])
    decode = ScheduledRunning(request_id="r", new_block_ids=(), resumed=False,
                              num_computed_tokens=95, num_scheduled_tokens=1)
    known = [*tokens, *range(300, 330)]  # two of the block's tokens not yet known
    assert plans.step([], [decode], tokens_of=lambda _: known).saves == ()


def test_a_resumed_request_takes_its_new_blocks() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens))
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.allocated("r", 6 * BLOCK)
    plans.step([new("r", 7, computed=6 * BLOCK, scheduled=8)], [])
    # preempted, then matched and allocated again: its blocks are all new
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.allocated("r", 6 * BLOCK)
    resumed = ScheduledRunning(request_id="r", new_block_ids=tuple(range(40, 47)),
                               resumed=True, num_computed_tokens=6 * BLOCK,
                               num_scheduled_tokens=8)
    (load,) = plans.step([], [resumed]).loads
    assert load.block_ids == tuple(range(40, 46))


def test_a_report_of_stored_blocks_makes_them_hits() -> None:
    tokens = prompt(200)
    plans = planner()
    plans.absorb(WorkerReport(stored=set(keys_of(TENANT_A, tokens))))
    assert plans.match("r", tokens, TENANT_A, num_computed_tokens=0) == 6 * BLOCK


def test_a_block_that_failed_to_load_is_not_promised_again() -> None:
    tokens = prompt(200)
    keys = keys_of(TENANT_A, tokens)
    plans = planner(held(TENANT_A, tokens))
    plans.absorb(WorkerReport(lost={keys[3]}))
    assert plans.match("r", tokens, TENANT_A, num_computed_tokens=0) == 3 * BLOCK


def test_a_finished_request_says_what_was_loaded_and_what_failed() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens))
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.allocated("r", 6 * BLOCK)
    plans.step([new("r", 7, computed=6 * BLOCK, scheduled=8)], [])
    plans.absorb(WorkerReport(loads={"r": LoadOutcome(num_loaded=4, failed_block_ids=(14, 15))}))
    assert plans.finished("r") == {"kvgate.loaded_tokens": 4 * BLOCK,
                                   "kvgate.failed_blocks": 2}
    assert plans.finished("r") is None  # forgotten


def test_a_request_finished_before_its_report_counts_what_was_ordered() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens))
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.allocated("r", 6 * BLOCK)
    plans.step([new("r", 7, computed=6 * BLOCK, scheduled=8)], [])
    # one token asked for: vLLM frees the request before it reads the step's report
    assert plans.finished("r") == {"kvgate.loaded_tokens": 6 * BLOCK,
                                   "kvgate.failed_blocks": 0}


def test_orders_survive_the_trip_between_processes() -> None:
    tokens = prompt(200)
    plans = planner(held(TENANT_A, tokens))
    plans.match("r", tokens, TENANT_A, num_computed_tokens=0)
    plans.allocated("r", 6 * BLOCK)
    orders = plans.step([new("r", 7, computed=6 * BLOCK, scheduled=8)], [])
    assert pickle.loads(pickle.dumps(orders)) == orders


@given(num_tokens=st.integers(1, 400), num_held=st.integers(0, 13), own=st.integers(0, 13))
def test_a_hit_is_never_the_whole_prompt_nor_more_than_is_held(num_tokens: int, num_held: int,
                                                               own: int) -> None:
    tokens = prompt(num_tokens)
    plans = planner(held(TENANT_A, tokens, num_blocks=num_held))
    own_tokens = min(own, (num_tokens - 1) // BLOCK) * BLOCK
    hit = plans.match("r", tokens, TENANT_A, num_computed_tokens=own_tokens)
    assert hit % BLOCK == 0
    assert own_tokens + hit <= num_tokens - 1
    assert hit <= max(0, min(num_held, num_tokens // BLOCK) * BLOCK - own_tokens)
