"""Priority lanes in the scheduler (issue 28): a tenant's better-priority requests go first among
its own, preempt its worse ones when they do not fit, and never move it ahead of another tenant
(pure bookkeeping; the step loop's side is tests/gateway/engine/test_preemption.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.engine.scheduling.scheduler import ScheduledChunk, ScheduleLimits, Scheduler

KV = 1_000


def scheduler(**limits: object) -> Scheduler:
    return Scheduler(ScheduleLimits(**limits))  # type: ignore[arg-type]


def running(s: Scheduler, *requests: tuple[int, str, int], kv: int = KV) -> None:
    """Submit and admit ``(request_id, tenant, priority)`` requests, each of ``kv`` bytes."""
    for request_id, tenant, priority in requests:
        s.submit(request_id, tenant=tenant, prompt_tokens=100, kv_bytes=kv, priority=priority)
    assert sorted(s.admit()) == sorted(request_id for request_id, _, _ in requests)


def test_a_tenants_lower_priority_value_is_admitted_before_its_earlier_requests() -> None:
    s = scheduler(max_running=1)
    s.submit(1, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=5)
    s.submit(2, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=5)
    s.submit(3, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=-1)
    assert s.admit() == [3]
    assert s.waiting_ids() == [1, 2]  # equal priorities keep their arrival order


def test_a_tenants_better_priority_request_prefills_first() -> None:
    s = scheduler(step_tokens=100, prefill_step_tokens=100)
    running(s, (1, "a", 10))
    running(s, (2, "a", 0))  # admitted later
    assert s.plan().chunks == (ScheduledChunk(request_id=2, num_tokens=100, is_decode=False),)


def test_a_lone_tenant_running_two_priority_lanes_keeps_to_small_steps() -> None:
    s = scheduler(step_tokens=64, prefill_step_tokens=1_024)
    s.submit(1, tenant="a", prompt_tokens=4_000, kv_bytes=KV)
    s.admit()
    assert s.plan().num_tokens == 1_024  # one lane alone: large prefill steps
    s.submit(2, tenant="a", prompt_tokens=100, kv_bytes=KV, priority=-1)
    s.admit()
    # the better lane's whole prompt in one step, nothing of the other beside it
    assert s.plan().chunks == (ScheduledChunk(request_id=2, num_tokens=100, is_decode=False),)
    assert s.plan().num_tokens == 64  # small steps while both lanes run
    s.finish(2)
    assert s.plan().num_tokens == 1_024


def test_a_lone_tenant_running_only_background_work_keeps_to_small_steps() -> None:
    s = scheduler(step_tokens=64, prefill_step_tokens=1_024)
    s.submit(1, tenant="a", prompt_tokens=4_000, kv_bytes=KV, priority=1)  # background
    s.admit()
    assert s.plan().num_tokens == 64  # a foreground request arriving waits one small step


def test_a_lone_tenant_running_only_urgent_work_gets_large_steps() -> None:
    s = scheduler(step_tokens=64, prefill_step_tokens=1_024)
    s.submit(1, tenant="a", prompt_tokens=4_000, kv_bytes=KV, priority=-1)
    s.admit()
    assert s.plan().num_tokens == 1_024


def test_priority_never_moves_a_tenant_ahead_of_another() -> None:
    s = scheduler(max_running=2)
    s.submit(1, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=-1_000)
    s.submit(2, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=-1_000)
    s.submit(3, tenant="b", prompt_tokens=10, kv_bytes=KV, priority=1_000)
    assert s.admit() == [1, 3]  # b holds less than a after a's first: b goes next


def test_priority_never_gives_a_tenant_the_first_prefill_budget_over_another() -> None:
    s = scheduler(step_tokens=64, prefill_step_tokens=64)
    running(s, (1, "a", -1_000))
    s.plan()  # a has received a step's tokens
    running(s, (2, "b", 1_000))
    assert s.plan().chunks[0].request_id == 2  # b received fewer: its prefill goes first


def test_a_better_priority_request_preempts_its_tenants_worst_latest_running_request() -> None:
    s = scheduler(max_running_per_tenant=3)
    running(s, (1, "a", 9), (2, "a", 9), (3, "a", 5))
    s.submit(4, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=0)
    assert s.admit() == []  # the tenant runs as many as it may
    assert s.preemptions() == [2]  # the worst priority, and of those the latest


def test_a_preempted_request_queues_again_at_its_place_reserving_in_full() -> None:
    s = scheduler(max_running_per_tenant=2)
    running(s, (1, "a", 9), (2, "a", 9))
    s.shrink_kv(2, KV // 4)  # it shares a cached prefix
    s.submit(3, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=9)
    s.submit(4, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=0)
    s.preempt(2, prompt_tokens=150)  # its prompt and the 50 tokens it generated
    assert s.kv_bytes_in_use == KV
    assert s.admit() == [4]
    assert s.waiting_ids() == [2, 3]  # ahead of the later request of its priority
    s.finish(4)
    assert s.admit() == [2]
    assert s.kv_bytes_in_use == 2 * KV
    planned = [chunk for _ in range(2) for chunk in s.plan().chunks if chunk.request_id == 2]
    assert planned == [ScheduledChunk(request_id=2, num_tokens=150, is_decode=False)]


def test_no_request_preempts_one_of_equal_or_better_priority() -> None:
    s = scheduler(max_running_per_tenant=2)
    running(s, (1, "a", 0), (2, "a", -3))
    s.submit(3, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=0)
    assert s.preemptions() == []


def test_no_request_preempts_another_tenants_request() -> None:
    s = scheduler(kv_budget_bytes=2 * KV, max_kv_share_per_tenant=1.0)
    running(s, (1, "b", 1_000), (2, "b", 1_000))
    s.submit(3, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=-1_000)
    assert s.preemptions() == []
    s.finish(1)
    assert s.admit() == [3]  # the first bytes freed are a's, as without priorities


def test_as_few_requests_are_preempted_as_make_room_in_the_kv_budget() -> None:
    s = scheduler(kv_budget_bytes=4 * KV, max_kv_share_per_tenant=1.0)
    s.submit(1, tenant="a", prompt_tokens=100, kv_bytes=2 * KV, priority=5)
    s.submit(2, tenant="a", prompt_tokens=100, kv_bytes=KV, priority=5)
    s.submit(3, tenant="a", prompt_tokens=100, kv_bytes=KV, priority=5)
    assert s.admit() == [1, 2, 3]
    s.submit(4, tenant="a", prompt_tokens=10, kv_bytes=2 * KV, priority=0)
    assert s.preemptions() == [3, 2]  # the two latest free two units; the first is spared


def test_nothing_is_preempted_when_preempting_everything_outranked_would_not_make_room() -> None:
    s = scheduler(kv_budget_bytes=3 * KV, max_kv_share_per_tenant=1.0)
    running(s, (1, "a", 0), (2, "a", 0), (3, "a", 9))
    s.submit(4, tenant="a", prompt_tokens=10, kv_bytes=2 * KV, priority=1)
    assert s.preemptions() == []


def test_a_tenant_beyond_its_kv_share_preempts_its_own_for_its_better_request() -> None:
    s = scheduler(kv_budget_bytes=4 * KV)  # a share is two units
    running(s, (1, "a", 5), (2, "a", 5))
    s.submit(3, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=0)
    assert s.admit() == []
    assert s.preemptions() == [2]


def test_a_tenant_holding_more_does_not_preempt_while_one_holding_less_waits_for_bytes() -> None:
    s = scheduler(kv_budget_bytes=4 * KV, max_kv_share_per_tenant=0.75)
    running(s, (1, "a", 5), (2, "a", 5), (3, "c", 0))
    s.submit(4, tenant="b", prompt_tokens=10, kv_bytes=2 * KV)  # holds nothing: next in line
    s.submit(5, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=0)
    assert s.preemptions() == []
    assert s.admit() == []  # b's request waits for the next bytes freed; no one overtakes it


def test_nothing_is_preempted_where_a_preempted_request_could_not_resume_unchanged() -> None:
    s = scheduler(max_running_per_tenant=1, can_preempt=False)
    running(s, (1, "a", 9))
    s.submit(2, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=0)
    assert s.preemptions() == []


def test_held_requests_and_warms_are_never_preempted() -> None:
    s = scheduler(max_running_per_tenant=2)
    running(s, (1, "a", 9))
    s.submit(2, tenant="a", prompt_tokens=100, kv_bytes=KV, priority=9, is_preemptible=False)
    assert s.admit() == [2]
    s.hold(1)  # waits for another's blocks: it holds no pages of its own
    s.submit(3, tenant="a", prompt_tokens=10, kv_bytes=KV, priority=0)
    assert s.preemptions() == []


UNITS = 8  # the KV budget of the property test, in KV-sized units


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.sampled_from("abc"), st.integers(1, UNITS),
                                    st.integers(-2, 2)),
                          st.integers(0, 20)), max_size=60),
       st.sampled_from([0.5, 1.0]))
def test_preemption_keeps_every_bound_takes_only_from_the_tenant_itself_and_ends(
        ops: list[tuple[str, int, int] | int], share: float) -> None:
    """A submit is (tenant, units, priority), a bare int finishes the n-th running request.
    Each turn preempts what ``preemptions`` lists, then admits, as the step loop does. Every
    preempted request is of the tenant whose head is next in line and of a worse priority than
    that head; the bounds hold after every turn; and once submissions stop everything runs (no
    request is preempted forever)."""
    max_running, per_tenant = 4, 3
    s = scheduler(kv_budget_bytes=UNITS * KV, max_kv_share_per_tenant=share,
                  max_running=max_running, max_running_per_tenant=per_tenant, max_queued=100,
                  max_queued_per_tenant=100)
    units: dict[int, int] = {}
    tenant_of: dict[int, str] = {}
    priority_of: dict[int, int] = {}
    now_running: set[int] = set()

    def turn() -> None:
        for victim in s.preemptions():
            assert victim in now_running
            head = min((i for i in s.waiting_ids() if tenant_of[i] == tenant_of[victim]),
                       key=lambda i: (priority_of[i], i))
            assert priority_of[victim] > priority_of[head]
            s.preempt(victim, prompt_tokens=1)
            now_running.discard(victim)
        now_running.update(s.admit())
        assert sum(units[i] for i in now_running) <= UNITS
        assert len(now_running) <= max_running
        for tenant in "abc":
            mine = [units[i] for i in now_running if tenant_of[i] == tenant]
            assert len(mine) <= per_tenant
            assert len(mine) <= 1 or sum(mine) <= share * UNITS

    for i, op in enumerate(ops):
        if isinstance(op, tuple):
            tenant, size, priority = op
            s.submit(i, tenant=tenant, prompt_tokens=1, kv_bytes=size * KV, priority=priority)
            units[i], tenant_of[i], priority_of[i] = size, tenant, priority
        elif now_running:
            request_id = sorted(now_running)[op % len(now_running)]
            s.finish(request_id)
            now_running.discard(request_id)
        turn()
    for _ in range(2 * len(ops) + 1):
        for request_id in list(now_running):
            s.finish(request_id)
            now_running.discard(request_id)
        turn()
    assert not now_running and s.num_waiting == 0
