"""The scheduler: admission bounds, step plans, fairness across tenants (pure bookkeeping)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.errors import QueueFull
from gateway.engine.scheduling.scheduler import ScheduledChunk, ScheduleLimits, Scheduler

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


def test_while_no_request_decodes_a_lone_tenant_prefills_up_to_the_prefill_step_budget(
        ) -> None:
    s = scheduler(step_tokens=100, prefill_step_tokens=400, prompt_ends_alone_from=0)
    s.submit(1, tenant="a", prompt_tokens=700, kv_bytes=KV)
    s.submit(2, tenant="a", prompt_tokens=30, kv_bytes=KV)
    s.admit()
    assert s.plan().chunks == (ScheduledChunk(request_id=1, num_tokens=400, is_decode=False),)
    assert s.plan().chunks == (ScheduledChunk(request_id=1, num_tokens=300, is_decode=False),
                               ScheduledChunk(request_id=2, num_tokens=30, is_decode=False))


def test_prompts_arriving_together_end_in_steps_of_their_own() -> None:
    s = scheduler(step_tokens=256, prefill_step_tokens=1_024, prompt_ends_alone_from=32)
    for request in (1, 2, 3):
        s.submit(request, tenant="a", prompt_tokens=75, kv_bytes=KV)
    s.admit()
    assert s.plan().chunks == (ScheduledChunk(request_id=1, num_tokens=75, is_decode=False),)
    s.start_decoding(1)
    assert s.plan().chunks == (ScheduledChunk(request_id=1, num_tokens=1, is_decode=True),
                               ScheduledChunk(request_id=2, num_tokens=75, is_decode=False))


def test_prompts_shorter_than_the_bound_still_share_a_step() -> None:
    s = scheduler(step_tokens=256, prefill_step_tokens=1_024, prompt_ends_alone_from=32)
    for request, tokens in ((1, 10), (2, 12), (3, 75)):
        s.submit(request, tenant="a", prompt_tokens=tokens, kv_bytes=KV)
    s.admit()
    assert [c.num_tokens for c in s.plan().chunks] == [10, 12, 75]


def test_decode_rows_do_not_count_towards_the_bound() -> None:
    s = scheduler(step_tokens=256, prefill_step_tokens=1_024, prompt_ends_alone_from=32,
                  max_running=64, max_running_per_tenant=64, max_queued_per_tenant=64)
    for request in range(40):
        s.submit(request, tenant="a", prompt_tokens=1, kv_bytes=KV)
    s.admit()
    s.plan()
    for request in range(40):
        s.start_decoding(request)
    s.submit(100, tenant="a", prompt_tokens=20, kv_bytes=KV)
    s.submit(101, tenant="a", prompt_tokens=20, kv_bytes=KV)
    s.admit()
    prompts = [(c.request_id, c.num_tokens) for c in s.plan().chunks if not c.is_decode]
    assert prompts == [(100, 20), (101, 20)]


def test_a_negative_prompt_end_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_ends_alone_from"):
        ScheduleLimits(prompt_ends_alone_from=-1)


def test_with_two_tenants_in_the_engine_prefill_steps_keep_to_the_step_budget() -> None:
    s = scheduler(step_tokens=100, prefill_step_tokens=400)
    s.submit(1, tenant="a", prompt_tokens=1_000, kv_bytes=KV)
    s.submit(2, tenant="b", prompt_tokens=30, kv_bytes=KV)
    s.admit()
    assert s.plan().chunks == (ScheduledChunk(request_id=1, num_tokens=100, is_decode=False),)
    assert s.plan().chunks == (ScheduledChunk(request_id=2, num_tokens=30, is_decode=False),
                               ScheduledChunk(request_id=1, num_tokens=70, is_decode=False))


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
    s = scheduler(kv_budget_bytes=2 * KV, max_kv_share_per_tenant=1.0)
    for i in range(3):
        s.submit(i, tenant="a", prompt_tokens=1, kv_bytes=KV)
    assert s.admit() == [0, 1]
    assert s.admit() == []
    s.finish(0)
    assert s.admit() == [2]


def test_a_request_that_shares_its_cached_prefix_frees_that_part_of_its_reservation() -> None:
    s = scheduler(kv_budget_bytes=2 * KV, max_kv_share_per_tenant=1.0)
    for i in range(3):
        s.submit(i, tenant="a", prompt_tokens=1, kv_bytes=KV)
    assert s.admit() == [0, 1]
    s.shrink_kv(0, KV // 4)  # it lists the device tier's pages: it writes a quarter itself
    s.shrink_kv(1, KV // 2)
    s.shrink_kv(1, KV)  # never grows back
    assert s.kv_bytes_in_use == KV // 4 + KV // 2
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


def test_a_newcomers_prefill_does_not_wait_behind_a_floods_large_steps() -> None:
    s = scheduler(step_tokens=64, prefill_step_tokens=1_024)
    for i in range(8):
        s.submit(i, tenant="flood", prompt_tokens=4_000, kv_bytes=KV)
    s.admit()
    assert s.plan().num_tokens == 1_024  # alone, the flood prefills in large steps
    s.submit(100, tenant="quiet", prompt_tokens=100, kv_bytes=KV)
    assert s.admit() == [100]
    # its whole prompt in one step (it fits a large one), nothing of the flood's beside it
    assert s.plan().chunks == (ScheduledChunk(request_id=100, num_tokens=100, is_decode=False),)
    assert s.plan().num_tokens == 64  # the flood, in small steps while another tenant is in
    s.finish(100)
    assert s.plan().num_tokens == 1_024  # alone again


def test_a_newcomer_whose_prompt_does_not_fit_a_large_step_gets_the_small_steps() -> None:
    s = scheduler(step_tokens=64, prefill_step_tokens=256)
    s.submit(1, tenant="flood", prompt_tokens=4_000, kv_bytes=KV)
    s.admit()
    s.plan()
    s.submit(100, tenant="quiet", prompt_tokens=300, kv_bytes=KV)
    s.admit()
    assert s.plan().chunks == (ScheduledChunk(request_id=100, num_tokens=64, is_decode=False),)


def test_a_tenant_holds_at_most_its_kv_share_and_another_tenant_starts_at_once() -> None:
    s = scheduler(kv_budget_bytes=4 * KV)  # the default share: half the budget
    for i in range(6):
        s.submit(i, tenant="flood", prompt_tokens=100, kv_bytes=KV)
    assert s.admit() == [0, 1]
    s.submit(100, tenant="quiet", prompt_tokens=10, kv_bytes=KV)
    assert s.admit() == [100]


def test_a_waiting_tenant_is_admitted_at_the_first_request_end_before_the_floods_queue() -> None:
    s = scheduler(kv_budget_bytes=4 * KV)
    for i in range(4):
        s.submit(i, tenant="flood", prompt_tokens=100, kv_bytes=KV)
    for i in range(10, 14):
        s.submit(i, tenant="other", prompt_tokens=100, kv_bytes=KV)
    assert s.admit() == [0, 10, 1, 11]  # the budget is full, both queue behind their own
    s.submit(100, tenant="quiet", prompt_tokens=10, kv_bytes=KV)
    assert s.admit() == []
    s.finish(0)
    assert s.admit() == [100]
    s.finish(1)
    assert s.admit() == [2]
    assert s.waiting_ids() == [3, 12, 13]


def test_a_large_waiting_request_is_not_overtaken_by_anothers_small_ones() -> None:
    s = scheduler(kv_budget_bytes=4 * KV)
    for i in range(6):
        s.submit(i, tenant="flood", prompt_tokens=100, kv_bytes=KV)
    s.submit(10, tenant="other", prompt_tokens=100, kv_bytes=2 * KV)
    assert s.admit() == [0, 10, 1]
    s.submit(100, tenant="quiet", prompt_tokens=100, kv_bytes=2 * KV)
    s.finish(0)
    assert s.admit() == []  # one unit free: quiet waits for it, the flood's next does not take it
    s.finish(1)
    assert s.admit() == [100]
    s.finish(10)
    assert s.admit() == [2, 3]


def test_a_request_larger_than_a_share_is_admitted_when_its_tenant_runs_nothing() -> None:
    s = scheduler(kv_budget_bytes=4 * KV, max_kv_share_per_tenant=0.25)
    s.submit(1, tenant="big", prompt_tokens=100, kv_bytes=4 * KV)
    s.submit(2, tenant="big", prompt_tokens=100, kv_bytes=KV)
    assert s.admit() == [1]  # the whole budget, alone
    s.submit(3, tenant="small", prompt_tokens=10, kv_bytes=KV)
    assert s.admit() == []
    s.finish(1)
    assert s.admit() == [3, 2]  # small was never served: first among equals


def test_a_tenant_beyond_its_share_never_goes_before_one_within_it() -> None:
    s = scheduler(kv_budget_bytes=8 * KV, max_kv_share_per_tenant=1.0)
    for i in range(8):
        s.submit(i, tenant="flood", prompt_tokens=100, kv_bytes=KV)
    assert s.admit() == list(range(8))
    s.submit(8, tenant="flood", prompt_tokens=100, kv_bytes=KV)
    s.submit(100, tenant="quiet", prompt_tokens=10, kv_bytes=KV)
    s.finish(0)
    assert s.admit() == [100]  # holding least goes first, even with borrowing allowed


def test_the_kv_share_must_be_a_fraction_of_the_budget() -> None:
    for share in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="max_kv_share_per_tenant"):
            ScheduleLimits(max_kv_share_per_tenant=share)


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


UNITS = 8  # the KV budget of the property test, in KV-sized units


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.sampled_from("abc"), st.integers(1, UNITS)),
                          st.integers(0, 20)), max_size=60),
       st.sampled_from([0.25, 0.5, 1.0]))
def test_no_tenant_exceeds_its_share_and_the_tenant_holding_least_goes_first(
        ops: list[tuple[str, int] | int], share: float) -> None:
    """Against a reference model: a submit is (tenant, units), a bare int finishes the n-th
    running request. Every admission is the tenant's oldest waiting request, keeps the tenant
    within its share (or alone in its first request), and goes to a tenant holding no more than
    any other whose head is within its share; admission stops only when the next in line does
    not fit; and once submissions stop, everything runs (no deadlock)."""
    max_running, per_tenant = 4, 3
    s = scheduler(kv_budget_bytes=UNITS * KV, max_kv_share_per_tenant=share,
                  max_running=max_running, max_running_per_tenant=per_tenant, max_queued=100,
                  max_queued_per_tenant=100)
    waiting: dict[str, list[tuple[int, int]]] = {t: [] for t in "abc"}
    running: dict[int, tuple[str, int]] = {}

    def held(tenant: str) -> float:
        mine = [units for t, units in running.values() if t == tenant]
        return max(sum(mine) / UNITS, len(mine) / max_running)

    def within_share(tenant: str) -> bool:
        mine = [units for t, units in running.values() if t == tenant]
        return bool(waiting[tenant]) and len(mine) < per_tenant and (
            not mine or (sum(mine) + waiting[tenant][0][1]) * KV <= share * UNITS * KV)

    def admit() -> None:
        for request_id in s.admit():
            tenant = next(t for t, queue in waiting.items() if queue and queue[0][0] == request_id)
            assert all(held(tenant) <= held(u) for u in "abc" if within_share(u))
            running[request_id] = (tenant, waiting[tenant].pop(0)[1])
            mine = [units for t, units in running.values() if t == tenant]
            assert len(mine) == 1 or sum(mine) <= share * UNITS
            assert sum(units for _, units in running.values()) <= UNITS
        in_line = [u for u in "abc" if within_share(u)]
        if in_line and len(running) < max_running:
            least = min(held(u) for u in in_line)
            free = UNITS - sum(units for _, units in running.values())
            assert any(waiting[u][0][1] > free for u in in_line if held(u) == least)

    for i, op in enumerate(ops):
        if isinstance(op, tuple):
            s.submit(i, tenant=op[0], prompt_tokens=1, kv_bytes=op[1] * KV)
            waiting[op[0]].append((i, op[1]))
        elif running:
            request_id = sorted(running)[op % len(running)]
            s.finish(request_id)
            del running[request_id]
        admit()
    for _ in range(len(ops) + 1):
        for request_id in list(running):
            s.finish(request_id)
            del running[request_id]
        admit()
    assert not running and s.num_waiting == 0 and not any(waiting.values())


def test_a_refused_newcomer_leaves_a_lone_tenant_its_large_prefill_steps() -> None:
    s = scheduler(step_tokens=100, prefill_step_tokens=400, max_queued=1, max_running=1)
    s.submit(1, tenant="a", prompt_tokens=1_000, kv_bytes=KV)
    assert s.admit() == [1]
    s.submit(2, tenant="a", prompt_tokens=1_000, kv_bytes=KV)
    with pytest.raises(QueueFull, match="max_queued"):
        s.submit(3, tenant="b", prompt_tokens=10, kv_bytes=KV)
    assert s.plan().num_tokens == 400


def test_a_lone_tenants_large_step_is_cut_to_what_takes_its_time_bound() -> None:
    """A tenant arriving while a flood's step runs waits for its end (issue 44): at 1 ms a
    token, 0.5 s holds 500 tokens, not the 1,024 of ``prefill_step_tokens``."""
    s = scheduler(step_tokens=256, prefill_step_tokens=1024, max_lone_step_s=0.5)
    s.submit(1, tenant="flood", prompt_tokens=4000, kv_bytes=KV)
    s.admit()
    assert s.plan(s_per_token=0.001).num_tokens == 500
    assert s.plan(s_per_token=None).num_tokens == 1024  # no figure yet: no bound
    assert s.plan(s_per_token=0.1).num_tokens == 256  # never below step_tokens
