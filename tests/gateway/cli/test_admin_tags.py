"""Tags end to end: ``kvgate prewarm --tag``, Warm/Generate ``tag``, ``kvgate admin evict --tag``
and ``ls`` against a real gateway (tiny Llama, 16-token blocks)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gateway.cli.main import main
from gateway.client import KvgateClient, KvgateError
from tests.gateway.cli.test_admin_cli import OTHER, _admin
from tests.gateway.grpc_harness import (
    ADMIN_KEY,
    KEY_A,
    KEY_B,
    LONG_PROMPT,
    RunningGateway,
    start_gateway,
    tiny_model,
)

RAW = "Untagged raw prompt text that is long enough to fill at least one block of tokens."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    running = start_gateway(tiny_model(tmp_path_factory.mktemp("tiny") / "model"),
                            admin_listener=True)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def _empty_cache_and_no_env(gateway: RunningGateway, monkeypatch: pytest.MonkeyPatch,
                            tmp_path: Path) -> None:
    for name in ("KVGATE_API_KEY", "KVGATE_API_KEYS", "KVGATE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    gateway.client(ADMIN_KEY).flush()


def _prewarm(gateway: RunningGateway, path: Path, text: str, *args: str) -> int:
    path.write_text(text, encoding="utf-8")
    return main(["prewarm", str(path), *args, "--port", str(gateway.port), "--api-key", KEY_A,
                 "--data-dir", str(path.parent / "no-data")])


def _system_cached(client: KvgateClient, text: str) -> int:
    return client.lookup(messages=[{"role": "system", "content": text}],
                         add_generation_prompt=False).cached_tokens


def _ls(gateway: RunningGateway, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    capsys.readouterr()
    assert main(_admin(gateway, "ls", "--json")) == 0
    listed = json.loads(capsys.readouterr().out)
    assert isinstance(listed, list)
    return listed


def test_evict_by_tag_leaves_the_prompt_cold_and_other_tags_and_untagged_warm(
    gateway: RunningGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    client = gateway.client(KEY_A)
    assert _prewarm(gateway, tmp_path / "v3.txt", LONG_PROMPT, "--tag", "docs-v3") == 0
    assert _prewarm(gateway, tmp_path / "v2.txt", OTHER, "--tag", "docs-v2") == 0
    client.warm(RAW)
    assert sorted(tuple(p["tags"]) for p in _ls(gateway, capsys)) == [  # type: ignore[arg-type]
        (), ("docs-v2",), ("docs-v3",)]
    assert main(_admin(gateway, "ls")) == 0
    assert "docs-v3" in capsys.readouterr().out

    assert main(_admin(gateway, "evict", "--tag", "docs-v3", "--yes")) == 0

    assert _system_cached(client, LONG_PROMPT) == 0
    assert _system_cached(client, OTHER) > 0
    assert client.lookup(RAW).cached_tokens > 0
    capsys.readouterr()
    assert main(_admin(gateway, "evict", "--tag", "docs-v3", "--yes")) == 3
    assert "no block of this replica is tagged 'docs-v3'" in capsys.readouterr().err


def test_a_generate_tag_marks_its_prompt_and_no_cache_with_a_tag_is_refused(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
) -> None:
    client = gateway.client(KEY_A)
    client.generate_text(LONG_PROMPT, max_tokens=2, tag="chat-1")
    assert [p["tags"] for p in _ls(gateway, capsys)] == [["chat-1"]]
    with pytest.raises(KvgateError) as excinfo:
        client.generate_text(LONG_PROMPT, max_tokens=2, tag="chat-1", no_cache=True)
    assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "no_cache" in excinfo.value.details


def test_an_invalid_tag_is_refused_at_every_edge(
    gateway: RunningGateway, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    for call in (lambda: gateway.client(KEY_A).warm(LONG_PROMPT, tag="docs v3"),
                 lambda: gateway.client(ADMIN_KEY).evict(tag="x" * 65),
                 lambda: gateway.client(KEY_A).generate_text(LONG_PROMPT, tag="")):
        with pytest.raises(KvgateError) as excinfo:
            call()
        assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "letters, digits, '.', '_' or '-'" in excinfo.value.details
    assert gateway.client(KEY_A).lookup(LONG_PROMPT).cached_tokens == 0  # refused before work
    capsys.readouterr()
    assert _prewarm(gateway, tmp_path / "p.txt", LONG_PROMPT, "--tag", "docs v3") == 2
    assert main(_admin(gateway, "evict", "--tag", "a/b", "--yes")) == 2
    assert capsys.readouterr().err.count("is not a tag") == 2


def test_a_tenant_cannot_evict_by_tag_and_an_admins_tenant_narrows_the_tag(
    gateway: RunningGateway,
) -> None:
    a, b = gateway.client(KEY_A), gateway.client(KEY_B)
    a.warm(LONG_PROMPT, tag="release")
    b.warm(LONG_PROMPT, tag="release")
    with pytest.raises(KvgateError) as excinfo:
        b.evict(tag="release", tenant="tenant-a")
    assert excinfo.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert a.lookup(LONG_PROMPT).cached_tokens > 0

    assert main(_admin(gateway, "evict", "--tag", "release", "--tenant", "tenant-b",
                       "--yes")) == 0

    assert b.lookup(LONG_PROMPT).cached_tokens == 0
    assert a.lookup(LONG_PROMPT).cached_tokens > 0
