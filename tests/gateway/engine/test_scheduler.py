"""The scheduler: admission bounds, step plans, fairness across tenants (pure bookkeeping)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.errors import QueueFull
from gateway.engine.scheduler import ScheduledChunk, ScheduleLimits, Scheduler

KV = 1_000


def scheduler(**limits: object) -> Scheduler:
    return Scheduler(ScheduleLimits(**limits))  # type: ignore[arg-type]


def test_decode_rows_come_first_then_prefill_chunks_up_to_the_step_budget() -> None:
    s = scheduler(step_tokens=100, prefill_step_tokens=100)
    s.submit(1, tenant="a", prompt_tokens=10, kv_bytes=KV)
    s.submit(2, tenant="a", prompt_tokens=500, kv_bytes=KV)
    assert s.admit() == [1, 2]
    first = s.plan()
    assert first.chunks == (ScheduledChunk(request_id=1, num_tokens=10, is_decode=False),
                            ScheduledChunk(request_id=2, num_tokens=90, is_decode=False))
    s.start_decoding(1)
    second = s.plan()
    assert second.chunks == (ScheduledChunk(request_id=1, num_tokens=1, is_decode=True),
                             ScheduledChunk(request_id=2, num_tokens=99, is_decode=False))
    assert second.num_tokens == 100


def test_while_no_request_decodes_a_step_prefills_up_to_the_prefill_step_budget() -> None:
    s = scheduler(step_tokens=100, prefill_step_tokens=400)
    s.submit(1, tenant="a", prompt_tokens=1_000, kv_bytes=KV)
    s.submit(2, tenant="b", prompt_tokens=30, kv_bytes=KV)
    s.admit()
    assert s.plan().chunks == (ScheduledChunk(request_id=1, num_tokens=400, is_decode=False),)
    assert s.plan().chunks == (ScheduledChunk(request_id=2, num_tokens=30, is_decode=False),
                               ScheduledChunk(request_id=1, num_tokens=370, is_decode=False))


def test_once_a_request_decodes_steps_keep_to_the_step_budget() -> None:
    s = scheduler(step_tokens=100, prefill_step_tokens=400)
    s.submit(1, tenant="a", prompt_tokens=10, kv_bytes=KV)
    s.submit(2, tenant="a", prompt_tokens=1_000, kv_bytes=KV)
    s.admit()
    s.plan()
    s.start_decoding(1)
    assert s.plan().chunks == (ScheduledChunk(request_id=1, num_tokens=1, is_decode=True),
                               ScheduledChunk(request_id=2, num_tokens=99, is_decode=False))


def test_cached_tokens_are_not_prefilled() -> None:
    s = scheduler(step_tokens=256)
    s.submit(1, tenant="a", prompt_tokens=300, kv_bytes=KV)
    s.admit()
    s.skip_prefill(1, 256)
    assert s.plan().chunks == (ScheduledChunk(request_id=1, num_tokens=44, is_decode=False),)


def test_a_tenant_over_its_queue_limit_is_refused_naming_the_limit() -> None:
    s = scheduler(max_queued_per_tenant=2, max_running=1)
    for i in range(2):
        s.submit(i, tenant="a", prompt_tokens=1, kv_bytes=KV)
    with pytest.raises(QueueFull, match="max_queued_per_tenant"):
        s.submit(9, tenant="a", prompt_tokens=1, kv_bytes=KV)
    s.submit(10, tenant="b", prompt_tokens=1, kv_bytes=KV)  # another tenant still gets in


def test_the_server_wide_queue_limit_is_refused_naming_the_limit() -> None:
    s = scheduler(max_queued=2)
    s.submit(1, tenant="a", prompt_tokens=1, kv_bytes=KV)
    s.submit(2, tenant="b", prompt_tokens=1, kv_bytes=KV)
    with pytest.raises(QueueFull, match="max_queued"):
        s.submit(3, tenant="c", prompt_tokens=1, kv_bytes=KV)


def test_one_tenant_runs_at_most_its_share_and_others_are_admitted_beside_it() -> None:
    s = scheduler(max_running=8, max_running_per_tenant=3)
    for i in range(10):
        s.submit(i, tenant="flood", prompt_tokens=100, kv_bytes=KV)
    s.submit(100, tenant="quiet", prompt_tokens=100, kv_bytes=KV)
    admitted = s.admit()
    assert sorted(admitted) == [0, 1, 2, 100]
    assert s.num_waiting == 7


def test_admission_waits_for_kv_budget_and_resumes_when_a_request_finishes() -> None:
    s = scheduler(kv_budget_bytes=2 * KV)
    for i in range(3):
        s.submit(i, tenant="a", prompt_tokens=1, kv_bytes=KV)
    assert s.admit() == [0, 1]
    assert s.admit() == []
    s.finish(0)
    assert s.admit() == [2]


def test_a_request_larger_than_the_whole_kv_budget_is_refused_at_once() -> None:
    s = scheduler(kv_budget_bytes=KV)
    with pytest.raises(ValueError, match="KV budget"):
        s.submit(1, tenant="a", prompt_tokens=1, kv_bytes=KV + 1)


def test_a_newly_arrived_tenant_gets_the_prefill_budget_before_a_flooding_one() -> None:
    s = scheduler(step_tokens=64, prefill_step_tokens=64, max_running=16,
                  max_running_per_tenant=8)
    for i in range(8):
        s.submit(i, tenant="flood", prompt_tokens=1_000, kv_bytes=KV)
    s.admit()
    for _ in range(5):
        s.plan()
    s.submit(100, tenant="quiet", prompt_tokens=100, kv_bytes=KV)
    assert s.admit() == [100]
    plan = s.plan()
    assert plan.chunks[0] == ScheduledChunk(request_id=100, num_tokens=64, is_decode=False)


def test_serial_mode_runs_one_request_with_chunks_ending_at_block_boundaries() -> None:
    s = scheduler(is_serial=True, block_tokens=64, step_tokens=1_000)
    s.submit(1, tenant="a", prompt_tokens=150, kv_bytes=KV)
    s.submit(2, tenant="b", prompt_tokens=10, kv_bytes=KV)
    assert s.admit() == [1]
    s.skip_prefill(1, 0)
    sizes = [s.plan().chunks[0].num_tokens for _ in range(3)]
    assert sizes == [64, 64, 22]
    s.finish(1)
    assert s.admit() == [2]


def test_finishing_a_waiting_request_drops_it_from_the_queue() -> None:
    s = scheduler(max_running=1)
    s.submit(1, tenant="a", prompt_tokens=1, kv_bytes=KV)
    s.submit(2, tenant="a", prompt_tokens=1, kv_bytes=KV)
    s.admit()
    s.finish(2)
    assert s.num_waiting == 0 and s.waiting_ids() == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 300)), min_size=1,
                max_size=25),
       st.integers(8, 200), st.integers(8, 400))
def test_every_prompt_token_is_planned_exactly_once_and_steps_stay_in_budget(
        requests: list[tuple[str, int]], step_tokens: int, prefill_step_tokens: int) -> None:
    s = scheduler(step_tokens=step_tokens, prefill_step_tokens=prefill_step_tokens,
                  max_running=4, max_running_per_tenant=2, max_queued=100,
                  max_queued_per_tenant=100)
    for i, (tenant, n) in enumerate(requests):
        s.submit(i, tenant=tenant, prompt_tokens=n, kv_bytes=KV)
    planned = {i: 0 for i in range(len(requests))}
    for _ in range(10_000):
        s.admit()
        if not s.num_running:
            break
        plan = s.plan()
        assert 0 < plan.num_tokens <= max(step_tokens, prefill_step_tokens)
        for chunk in plan.chunks:
            planned[chunk.request_id] += chunk.num_tokens
            if planned[chunk.request_id] == requests[chunk.request_id][1]:
                s.finish(chunk.request_id)
    assert planned == {i: n for i, (_, n) in enumerate(requests)}
