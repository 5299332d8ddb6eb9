"""CircuitBreaker: closed → open after N consecutive failures → half-open probe → closed/open.

Time is a fake clock; nothing sleeps.
"""

from __future__ import annotations

import threading

import pytest

from tiers.breaker import CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def state_of(breaker: CircuitBreaker) -> str:
    return breaker.state  # typed str, so that mypy does not narrow it between asserts


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def breaker(clock: FakeClock) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=3, reset_after_s=5.0, clock=clock)


def test_starts_closed_and_allows(breaker: CircuitBreaker) -> None:
    assert state_of(breaker) == "closed"
    assert breaker.allow()


def test_opens_after_threshold_consecutive_failures(breaker: CircuitBreaker) -> None:
    breaker.record_failure()
    breaker.record_failure()
    assert state_of(breaker) == "closed"
    assert breaker.allow()
    breaker.record_failure()
    assert state_of(breaker) == "open"
    assert not breaker.allow()


def test_success_resets_the_failure_count(breaker: CircuitBreaker) -> None:
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    breaker.record_failure()
    assert state_of(breaker) == "closed"


def test_open_refuses_until_reset_then_lets_exactly_one_probe(
    breaker: CircuitBreaker, clock: FakeClock
) -> None:
    breaker.trip()
    clock.now += 4.999
    assert not breaker.allow()
    clock.now += 0.001
    assert state_of(breaker) == "half_open"
    assert breaker.allow()  # the probe
    assert state_of(breaker) == "half_open"
    assert [breaker.allow() for _ in range(10)] == [False] * 10


def test_probe_success_closes(breaker: CircuitBreaker, clock: FakeClock) -> None:
    breaker.trip()
    clock.now += 5.0
    assert breaker.allow()
    breaker.record_success()
    assert state_of(breaker) == "closed"
    assert all(breaker.allow() for _ in range(10))


def test_probe_failure_reopens_for_a_full_period(breaker: CircuitBreaker, clock: FakeClock) -> None:
    breaker.trip()
    clock.now += 5.0
    assert breaker.allow()
    clock.now += 1.0  # the probe took a second to fail
    breaker.record_failure()
    assert state_of(breaker) == "open"
    clock.now += 4.999
    assert not breaker.allow()
    clock.now += 0.001
    assert breaker.allow()


def test_lost_probe_is_replaced_after_a_period(breaker: CircuitBreaker, clock: FakeClock) -> None:
    breaker.trip()
    clock.now += 5.0
    assert breaker.allow()  # this probe's caller never reports back
    clock.now += 4.9
    assert not breaker.allow()
    clock.now += 0.1
    assert breaker.allow()


def test_late_failure_while_open_does_not_delay_the_probe(
    breaker: CircuitBreaker, clock: FakeClock
) -> None:
    breaker.trip()
    clock.now += 4.0
    breaker.record_failure()  # from a call admitted before the breaker opened
    clock.now += 1.0
    assert breaker.allow()


def test_trip_opens_a_closed_breaker_at_once(breaker: CircuitBreaker) -> None:
    breaker.trip()
    assert state_of(breaker) == "open"
    assert not breaker.allow()


def test_threshold_one_opens_on_first_failure(clock: FakeClock) -> None:
    breaker = CircuitBreaker(failure_threshold=1, reset_after_s=1.0, clock=clock)
    breaker.record_failure()
    assert state_of(breaker) == "open"


@pytest.mark.parametrize(
    ("threshold", "reset"), [(0, 1.0), (-1, 1.0), (1, 0.0), (1, -1.0), (1, float("nan"))]
)
def test_rejects_bad_settings(threshold: int, reset: float) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=threshold, reset_after_s=reset)


def test_concurrent_callers_get_exactly_one_probe(
    breaker: CircuitBreaker, clock: FakeClock
) -> None:
    breaker.trip()
    clock.now += 5.0
    num_threads = 16
    barrier = threading.Barrier(num_threads)
    answers: list[bool] = []
    lock = threading.Lock()

    def ask() -> None:
        barrier.wait()
        allowed = breaker.allow()
        with lock:
            answers.append(allowed)

    threads = [threading.Thread(target=ask) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == [False] * (num_threads - 1) + [True]


def test_concurrent_failures_open_exactly_at_threshold(clock: FakeClock) -> None:
    breaker = CircuitBreaker(failure_threshold=1000, reset_after_s=5.0, clock=clock)

    def fail_111_times() -> None:
        for _ in range(111):
            breaker.record_failure()

    threads = [threading.Thread(target=fail_111_times) for _ in range(9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert state_of(breaker) == "closed"  # 9 * 111 = 999 failures, none lost
    breaker.record_failure()
    assert state_of(breaker) == "open"
