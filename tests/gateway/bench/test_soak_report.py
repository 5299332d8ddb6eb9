"""How a soak run is judged (``gateway.bench.soak.report``): wrong answers, errors outside a
fault's window or of an unexpected class, crashes, pinned prefixes lost; which faults a run
makes."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.bench.soak.faults import FAULTS, GRACE_S, FaultWindow, fault_kinds, not_run
from gateway.bench.soak.pins import PinCheck
from gateway.bench.soak.processes import ProcessSample
from gateway.bench.soak.report import Sampled, SoakReport
from gateway.bench.soak.workload import Outcome, catalogue, pinned_prompts

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


def test_a_pinned_prefix_lost_from_disk_fails_the_run_though_answered_right() -> None:
    """Pins are kept over restarts (gateway.cache.pins): the check's kill -9 and restart of
    every replica must find each pinned prefix whole on disk."""
    report = _report()
    report.pins = [
        PinCheck(prompt="pinned-0", replica="replica-0", pinned_tokens=320, disk_tokens=320,
                 served_tokens=320, is_equal=True),
        PinCheck(prompt="pinned-1", replica="replica-1", pinned_tokens=320, disk_tokens=192,
                 served_tokens=320, is_equal=True)]
    assert report.problems() == [
        "pinned prefix pinned-1 lost on replica-1: 192 of its 320 tokens on disk, 320 served "
        "warm, equal to the cold answer"]


def test_a_pinned_prefix_answered_wrong_fails_the_run_though_kept_on_disk() -> None:
    report = _report()
    report.pins = [PinCheck(prompt="pinned-1", replica="replica-1", pinned_tokens=320,
                            disk_tokens=320, served_tokens=320, is_equal=False)]
    assert report.problems() == [
        "pinned prefix pinned-1 lost on replica-1: 320 of its 320 tokens on disk, 320 served "
        "warm, NOT the cold answer"]


def test_a_pinned_prefix_served_cold_or_wrong_is_not_kept() -> None:
    assert not PinCheck(prompt="p", replica="r", pinned_tokens=64, disk_tokens=64,
                        served_tokens=0, is_equal=True).is_kept
    assert not PinCheck(prompt="p", replica="r", pinned_tokens=64, disk_tokens=64,
                        served_tokens=64, is_equal=False).is_kept
    assert not PinCheck(prompt="p", replica="r", pinned_tokens=64, error="UNAVAILABLE").is_kept


def test_a_standalone_run_makes_no_failover_and_a_cluster_run_makes_every_fault() -> None:
    assert "redis_cluster_failover" not in fault_kinds(cluster=False)
    assert set(fault_kinds(cluster=True)) == set(FAULTS)
    assert fault_kinds(cluster=True)[:2] == ["redis_kill_restart", "redis_cluster_failover"]
    assert set(not_run(cluster=False)) == {"redis_cluster_failover"}
    assert not_run(cluster=True) == {}


def test_the_pinned_prefixes_share_no_block_with_what_the_load_pins() -> None:
    prompts = catalogue(families=3, questions=4, num_rules=24)
    pinned = pinned_prompts(prompts)
    assert [p.name for p in pinned] == ["pinned-0", "pinned-1"]
    others = [p for p in prompts if p not in pinned]
    for prompt in pinned:  # the system prompts differ from their first word
        first = prompt.messages[0]["content"].split()[0]
        assert all(o.messages[0]["content"].split()[0] != first for o in others)


def test_a_pinned_prefix_lost_after_a_faults_restart_fails_the_run_too() -> None:
    report = _report()
    report.pins = [PinCheck(prompt="pinned-0", replica="replica-0", pinned_tokens=640,
                            disk_tokens=576, served_tokens=640, is_equal=True,
                            was_restarted=True)]
    assert report.problems() == [
        "pinned prefix pinned-0 lost on replica-0: 576 of its 640 tokens on disk, 640 served "
        "warm, equal to the cold answer"]


def _sampled(process: str, sizes_mib: Sequence[int | None],
             every_s: float = 100.0) -> list[Sampled]:
    return [Sampled(i * every_s, process,
                    ProcessSample(None if mib is None else mib << 20, 10, 20))
            for i, mib in enumerate(sizes_mib)]


def test_memory_growth_counts_from_ten_minutes_after_a_restart_seen_between_two_samples() -> None:
    report = _report()
    # killed and restarted between the samples at 200 and 300 s; its tiers fill for minutes
    report.samples = _sampled("replica-0", [1000, 1100, 1200, 300, 900, 950, 980, 990, 1000,
                                            1005, 1010, 1010, 1015, 1020])
    # steady from 900 s (600 s after the restart seen at 300 s): 1005 -> 1020 MiB
    growth = report.growth("replica-0")
    assert growth is not None and abs(growth - (1020 - 1005) / 1005) < 1e-9


def test_a_life_shorter_than_ten_minutes_after_its_start_is_not_judged() -> None:
    report = _report()
    report.samples = _sampled("replica-0", [1000, 1500, 2000, None, 900, 1800])
    assert report.growth("replica-0") is None
    assert report.problems() == []


def test_the_largest_steady_growth_of_any_life_is_the_replicas() -> None:
    report = _report()
    first = [1000] * 6 + [1000, 1030, 1040]   # +4 % from 600 s on
    second = [400] * 6 + [1000, 1010]         # restarted at 900 s; +1 % from 1500 s on
    report.samples = _sampled("replica-0", first + second)
    growth = report.growth("replica-0")
    assert growth is not None and abs(growth - 0.04) < 1e-9


def test_a_replica_growing_more_than_five_percent_when_steady_fails_the_run() -> None:
    report = _report()
    report.samples = _sampled("replica-1", [1000] * 7 + [1030, 1060])
    assert report.problems() == [
        "replica-1's resident memory grew +6.0% from 10 minutes after a start to the end of "
        "that life (at most +5%)"]


def test_redis_memory_is_printed_not_judged() -> None:
    report = _report()
    report.samples = _sampled("redis", [100] * 7 + [150, 200])
    assert report.problems() == []
