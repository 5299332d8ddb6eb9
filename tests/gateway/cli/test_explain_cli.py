"""``kvgate explain`` against a real gateway: gRPC and HTTP over one engine and one
``PromptComparisons`` (``test_openai_http``'s, as ``kvgate serve`` builds them), so that the
ids it names come from a gRPC Generate or an ``anthropic`` SDK call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import pytest

from gateway.cli.main import main
from tests.gateway.grpc_harness import BLOCK, KEY_A, KEY_B, LONG_PROMPT
from tests.gateway.service import test_openai_http
from tests.gateway.service.test_openai_http import MODEL, Stack, unique

loaded = test_openai_http.loaded
stack = test_openai_http.stack

ASK = {"role": "user", "content": "How do refunds work for an order that shipped twice?"}


@pytest.fixture(autouse=True)
def _no_kvgate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("KVGATE_API_KEY", "KVGATE_API_KEYS", "KVGATE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no data/dev-api-key of a `make serve` in the checkout


def _conversation(tmp_path: Path, *messages: dict[str, str]) -> Path:
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(list(messages)), encoding="utf-8")
    return path


def _explain(stack: Stack, previous: str, *args: str, key: str = KEY_A) -> list[str]:
    return ["explain", "--previous", previous, "--port", str(stack.running.port),
            "--api-key", key, *args]


def _generated(stack: Stack, messages: list[dict[str, str]]) -> Any:
    _, usage = stack.running.client(KEY_A).generate_text(messages=messages, max_tokens=2)
    return usage


def test_explain_names_the_changed_system_prompt_and_what_the_cache_holds_now(
        stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    earlier = _generated(stack, [{"role": "system", "content": unique(LONG_PROMPT)}, ASK])
    chat = _conversation(tmp_path, {"role": "system", "content": unique(LONG_PROMPT)})
    assert main(_explain(stack, earlier.request_id, "--messages", str(chat),
                         ASK["content"])) == 0
    lines = capsys.readouterr().out.splitlines()
    cached = earlier.prompt_tokens // BLOCK * BLOCK
    assert lines[:3] == [
        f"compared with {earlier.request_id}: the system messages (instructions) changed",
        "  first block that differs: 0 (0 tokens before the changed part are the same)",
        f"  {earlier.request_id} left {cached} tokens in the cache; this prompt cannot read "
        f"{cached} of them"]
    assert lines[3].startswith("cached now: 0 of ") and "the first block not cached is 0" in (
        lines[3])
    assert len(lines) == 4


def test_explain_json_carries_the_comparison_and_the_lookup(
        stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    system = {"role": "system", "content": unique(LONG_PROMPT)}
    earlier = _generated(stack, [system, ASK])
    chat = _conversation(tmp_path, system, ASK, {"role": "assistant", "content": "Sure."})
    assert main(_explain(stack, earlier.request_id, "--messages", str(chat), "--json",
                         "And gift cards?")) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["previous_request_id"] == earlier.request_id
    assert answer["comparison"] == {
        "previous_known": True, "changed_part": None, "first_changed_message": None,
        "common_tokens": 0, "first_differing_block": None,
        "previous_cached_tokens": earlier.prompt_tokens // BLOCK * BLOCK, "missed_tokens": 0}
    assert answer["lookup"]["cached_tokens"] > 0
    assert set(answer["lookup"]) >= {"prompt_tokens", "cached_tokens_by_tier",
                                     "diverges_at_block", "text_around_divergence"}


def test_explain_names_an_anthropic_message_id(
        stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    system = unique(LONG_PROMPT)
    claude: Any = anthropic.Anthropic(base_url=stack.url.removesuffix("/v1"), api_key=KEY_A,
                                      max_retries=0, timeout=60.0)
    with claude:
        first = claude.messages.create(model=MODEL, max_tokens=2, system=system,
                                       messages=[ASK], diagnostics={"previous_message_id": None})
    assert main(_explain(stack, first.id, ASK["content"])) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"compared with {first.id}: the system messages (instructions) changed")


def test_explain_of_another_tenants_id_says_previous_request_unknown_and_nothing_more(
        stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    theirs = _generated(stack, [ASK])
    assert main(_explain(stack, theirs.request_id, ASK["content"], key=KEY_B)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{theirs.request_id}: previous request unknown (")
    assert lines[1].startswith("cached now: 0 of ") and len(lines) == 2


def test_explain_without_a_prompt_is_a_usage_error(
        stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_explain(stack, "gen_" + "0" * 24)) == 2
    assert capsys.readouterr().err == ("kvgate explain: give the prompt to compare: a PROMPT, "
                                       "--messages FILE, or both\n")


def test_explain_reports_a_refused_id_in_one_line_and_fails(
        stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_explain(stack, "not an id", "hello")) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvgate explain: ") and "previous_request_id must be an id" in err
    assert err.count("\n") == 1 and "Traceback" not in err
