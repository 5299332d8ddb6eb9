"""How a soak run is judged (``gateway.bench.soak.report``): wrong answers, errors outside a
fault's window or of an unexpected class, crashes."""

from __future__ import annotations

from gateway.bench.soak.faults import GRACE_S, FaultWindow
from gateway.bench.soak.report import SoakReport
from gateway.bench.soak.workload import Outcome

FAULT = FaultWindow(kind="redis_pause", started=100.0, ended=110.0, note="stopped")


def _report(*outcomes: Outcome, crashed: tuple[str, ...] = ()) -> SoakReport:
    return SoakReport(outcomes=list(outcomes), windows=[FAULT], samples=[], started=0.0,
                      warmup_s=10.0, crashed=list(crashed))


def _error(code: str, started: float, ended: float) -> Outcome:
    return Outcome(kind="chat", replica=0, started=started, ended=ended, result="error",
                   error=code)


def test_good_answers_and_refusals_pass() -> None:
    assert _report(Outcome(kind="chat", replica=0, started=1.0, ended=2.0),
                   Outcome(kind="chat", replica=1, started=1.0, ended=2.0,
                           result="refused")).problems() == []


def test_one_wrong_answer_fails_the_run() -> None:
    wrong = Outcome(kind="chat", replica=1, started=1.0, ended=2.0, result="wrong",
                    prompt="chat-0-1")
    assert "1 wrong answers" in _report(wrong).problems()[0]


def test_an_expected_error_inside_a_fault_window_and_its_grace_passes() -> None:
    assert _report(_error("UNAVAILABLE", 105.0, 106.0),
                   _error("DEADLINE_EXCEEDED", 110.0 + GRACE_S - 1, 130.0)).problems() == []


def test_an_error_outside_every_window_fails_the_run() -> None:
    assert "outside any fault window" in _report(_error("UNAVAILABLE", 50.0, 51.0)).problems()[0]


def test_an_unexpected_error_class_inside_a_window_fails_the_run() -> None:
    assert "INTERNAL during a fault" in _report(_error("INTERNAL", 105.0, 106.0)).problems()[0]


def test_a_replica_that_exits_on_its_own_fails_the_run() -> None:
    assert _report(crashed=("replica-1",)).problems() == [
        "replica-1 exited on its own (not killed by a fault)"]


def test_recovery_is_from_the_faults_end_to_the_first_good_answer_after_it() -> None:
    report = _report(Outcome(kind="chat", replica=0, started=111.0, ended=113.5),
                     Outcome(kind="pin", replica=0, started=110.5, ended=111.0))
    assert report.recovery_s(FAULT) == 3.5
