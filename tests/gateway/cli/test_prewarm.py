"""``kvgate prewarm`` against a real gateway (tiny Llama, 16-token blocks), through ``main``."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli.main import main
from gateway.cli.prewarm import PrewarmEntry, PrewarmResult, Progress, read_file
from tests.gateway.grpc_harness import (
    ADMIN_KEY,
    KEY_A,
    KEY_B,
    RunningGateway,
    start_gateway,
    tiny_model,
)

SUPPORT = ("You are the support assistant of Example Corp. Be brief, be kind, and always "
           "link the status page when something is down.")
BILLING = ("You are the billing assistant. Never promise refunds; explain invoices line by "
           "line and in plain words for every customer.")
RAW = "Translate the following sentences from English into French, keeping the tone exactly:"
SHARED = "Shared preamble for every tenant: answer in English and keep answers under fifty words."
LEGAL = "You are the legal assistant of tenant b. Quote clauses exactly, then explain them."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    running = start_gateway(tiny_model(tmp_path_factory.mktemp("tiny") / "model"))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def _no_kvgate_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVGATE_API_KEY", "KVGATE_API_KEYS", "KVGATE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)


def _prewarm(gateway: RunningGateway, tmp_path: Path, *args: str) -> list[str]:
    return ["prewarm", *args, "--port", str(gateway.port), "--api-key", KEY_A,
            "--admin-key", ADMIN_KEY, "--tenant-key", f"{KEY_B}=tenant-b",
            "--data-dir", str(tmp_path / "no-data")]


def _prompt_dir(root: Path) -> Path:
    prompts = root / "prompts"
    (prompts / "team").mkdir(parents=True)
    (prompts / "support.txt").write_text(SUPPORT, encoding="utf-8")
    (prompts / "team" / "entries.yaml").write_text(
        f"- prompt: {json.dumps(RAW)}\n"
        "  ttl_s: 600\n"
        f"- messages:\n    - role: system\n      content: {json.dumps(BILLING)}\n"
        f"- prompt: {json.dumps(SHARED)}\n"
        "  scope: shared\n"
        "  pin: true\n",
        encoding="utf-8")
    (prompts / "team" / "legal.json").write_text(
        json.dumps([{"prompt": LEGAL, "tenant": "tenant-b", "pin": True}]), encoding="utf-8")
    (prompts / ".hidden.txt").write_text("never read", encoding="utf-8")
    return prompts


def test_prewarm_a_directory_then_again_is_all_cached_and_faster(
    gateway: RunningGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    prompts = _prompt_dir(tmp_path)

    assert main(_prewarm(gateway, tmp_path, str(prompts))) == 0
    first = capsys.readouterr()
    lines = first.out.splitlines()
    assert lines[0].split() == ["prompt", "tokens", "blocks", "bytes", "tiers", "time",
                                "already", "cached"]
    rows = lines[2:7]
    assert all(row.endswith("  no") and "  device  " in row for row in rows), first.out
    first_ms = sum(float(row.rsplit(" ms", 1)[0].rsplit(None, 1)[1]) for row in rows)
    assert lines[7] == "5 warmed (0 already cached), 0 failed"
    assert "You are the support assistant" in first.out
    assert first.err.count("] warmed ") == 5  # stderr is no TTY: one line per prompt
    assert "never read" not in first.out + first.err

    client_a = gateway.client(KEY_A)
    support = client_a.lookup(messages=[{"role": "system", "content": SUPPORT}],
                              add_generation_prompt=False)
    assert support.cached_tokens > 0
    assert support.cached_tokens == support.num_prompt_blocks * 16
    assert client_a.lookup(RAW).cached_tokens > 0
    assert client_a.lookup(messages=[{"role": "system", "content": BILLING}],
                           add_generation_prompt=False).cached_tokens > 0
    assert client_a.lookup(SHARED).cached_tokens > 0  # tenant scope sees shared blocks
    assert gateway.client(KEY_B).lookup(LEGAL).cached_tokens > 0
    assert client_a.lookup(LEGAL).cached_tokens == 0  # tenant-b's, not tenant-a's
    pinned = [p for p in gateway.client(ADMIN_KEY).list_prefixes() if p.is_pinned]
    assert sorted(p.tenant for p in pinned) == ["shared", "tenant-b"]

    assert main([*_prewarm(gateway, tmp_path, str(prompts)), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["failures"] == []
    assert len(second["results"]) == 5
    assert all(r["already_cached"] and r["new_blocks"] == 0 for r in second["results"])
    assert all(r["tiers"] == ["device"] for r in second["results"])
    assert sum(r["time_s"] for r in second["results"]) * 1000 < first_ms


def test_bad_files_are_reported_with_their_reason_and_the_good_ones_warm(
    gateway: RunningGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    good = "You are a good prompt that warms even beside broken files, in several blocks."
    (bad / "good.txt").write_text(good, encoding="utf-8")
    (bad / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (bad / "broken.yaml").write_text("- prompt: [unclosed\n", encoding="utf-8")
    (bad / "broken.json").write_text("[{\"prompt\": ", encoding="utf-8")
    (bad / "typo.yaml").write_text("- promt: hello\n  ttl: 5\n", encoding="utf-8")
    (bad / "long.txt").write_text("The quick brown fox jumps over the lazy dog. " * 150,
                                  encoding="utf-8")
    missing = tmp_path / "missing.txt"

    code = main([*_prewarm(gateway, tmp_path, str(bad), str(missing)), "--json"])
    assert code == 1
    report = json.loads(capsys.readouterr().out)
    reasons = {Path(f["source"]).name: f["reason"] for f in report["failures"]}
    assert reasons["missing.txt"] == "no such file or directory"
    assert reasons["latin1.txt"].startswith("not UTF-8 text")
    assert reasons["broken.yaml"].startswith("invalid YAML")
    assert reasons["broken.json"].startswith("invalid JSON")
    assert "unknown keys ['promt', 'ttl']" in reasons["typo.yaml"]
    assert reasons["long.txt"].startswith("INVALID_ARGUMENT: ")
    assert "2047" in reasons["long.txt"] or "context" in reasons["long.txt"]
    assert [Path(r["source"]).name for r in report["results"]] == ["good.txt"]
    assert gateway.client(KEY_A).lookup(
        messages=[{"role": "system", "content": good}], add_generation_prompt=False,
    ).cached_tokens > 0


def test_admin_only_entries_fail_without_an_admin_key(
    gateway: RunningGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    file = tmp_path / "shared.yaml"
    file.write_text("- prompt: shared but no admin key here, so it is refused\n"
                    "  scope: shared\n", encoding="utf-8")
    code = main(["prewarm", str(file), "--port", str(gateway.port), "--api-key", KEY_A,
                 "--data-dir", str(tmp_path)])
    assert code == 1
    assert "the shared scope needs an admin key" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["prewarm"])
    assert exc.value.code == 2
    assert main(["prewarm", "x.txt", "--tenant-key", "no-equals-sign"]) == 2
    assert "is not KEY=TENANT" in capsys.readouterr().err


def test_read_file_rejects_bad_entries_naming_the_problem(tmp_path: Path) -> None:
    file = tmp_path / "e.yaml"
    cases = {
        "- {prompt: a, messages: [{role: system, content: b}]}\n": "exactly one of",
        "- {prompt: a, scope: global}\n": "`scope` must be one of",
        "- {prompt: a, ttl_s: -1}\n": "`ttl_s` must be a positive",
        "- {prompt: a, pin: maybe}\n": "`pin` must be true or false",
        "prompt: a\n": "expected a non-empty list",
    }
    for text, reason in cases.items():
        file.write_text(text, encoding="utf-8")
        with pytest.raises(Exception, match=reason):
            read_file(file)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_tty_is_a_bar_with_tokens_per_second_and_eta() -> None:
    now = [0.0]
    err = _Tty()
    entries = [PrewarmEntry(source=f"p{i}", prompt="x" * 100) for i in range(2)]
    progress = Progress(err, total_chars=200, num_entries=2, clock=lambda: now[0])
    result = PrewarmResult(source="p0", label="x", num_tokens=500, num_blocks=31,
                           num_new_blocks=31, num_bytes=1, tiers=("device",), elapsed_s=1.0)
    now[0] = 1.0
    progress.finished(entries[0], result, None)
    assert err.getvalue() == f"\r[{'#' * 15}{'.' * 15}] 1/2 500 tok/s ETA 1s   "
    now[0] = 2.0
    progress.finished(entries[1], result, None)
    assert err.getvalue().endswith(f"\r[{'#' * 30}] 2/2 500 tok/s ETA 0s   \n")
