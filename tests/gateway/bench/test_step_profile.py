"""``kvgate bench profile``: the engine thread's time by part under the chat load, sampled
(issue 45, item 1); the sampler files each sample under the innermost frame a rule names."""

from __future__ import annotations

import io
import sys
import threading
import time
from pathlib import Path

from gateway.bench.stack_sampler import ENGINE_RULES, IDLE, OTHER, Rule, StackSampler, classify
from gateway.bench.step_profile import ProfileOptions, run_profile_benchmark
from tests.tiny_llama import save_tiny_llama

THIS_FILE = Path(__file__).name


def _frame_of(thread: threading.Thread):  # noqa: ANN202 -- a frame object
    assert thread.ident is not None
    return sys._current_frames()[thread.ident]


def test_a_thread_waiting_on_an_event_is_waiting_for_work() -> None:
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        deadline = time.monotonic() + 5  # until the thread is inside its wait
        while _frame_of(thread).f_code.co_name != "wait" and time.monotonic() < deadline:
            time.sleep(0.001)
        assert classify(_frame_of(thread), ENGINE_RULES) == IDLE
    finally:
        release.set()
        thread.join()


def test_the_innermost_frame_a_rule_names_takes_the_sample() -> None:
    rules = (Rule("outer", (THIS_FILE,), ("_outer",)), Rule("inner", (THIS_FILE,), ("_inner",)))
    seen: list[str] = []

    def _inner() -> None:
        seen.append(classify(sys._getframe(), rules))

    def _outer() -> None:
        _inner()

    _outer()
    assert seen == ["inner"]
    assert classify(sys._getframe(), ()) == OTHER


def test_the_sampler_counts_a_busy_threads_samples() -> None:
    stop = threading.Event()

    def _busy() -> None:
        while not stop.is_set():
            sum(range(1000))

    thread = threading.Thread(target=_busy)
    thread.start()
    assert thread.ident is not None
    sampler = StackSampler(thread.ident, rules=(Rule("busy", (THIS_FILE,), ("_busy",)),)).start()
    threading.Event().wait(0.2)
    parts = sampler.stop()
    stop.set()
    thread.join()
    assert parts["busy"] > 0 and set(parts) <= {"busy", OTHER}


def test_the_profile_benchmark_divides_the_engine_threads_time_under_the_chat_load(
        tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "model")
    out = io.StringIO()
    profiles = run_profile_benchmark(ProfileOptions(
        model=str(model), cache_dir=tmp_path / "cache", users=(1, 2), rounds=2, max_tokens=4,
        rules=3), out=out)
    assert [p.users for p in profiles] == [1, 2]
    assert [p.replies for p in profiles] == [2, 4]
    assert all(sum(p.parts.values()) > 0 and p.cores > 0 for p in profiles)
    assert any(p.parts["products (projections, experts)"] for p in profiles)
    assert "share of the engine thread" in out.getvalue()
