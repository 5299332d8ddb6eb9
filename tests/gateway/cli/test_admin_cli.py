"""``kvgate admin`` against a real gateway (tiny Llama, 16-token blocks)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cli.admin import parse_duration
from gateway.cli.main import main
from gateway.config.limits import LimitSettings
from tests.gateway.grpc_harness import (
    ADMIN_KEY,
    KEY_A,
    KEY_B,
    LONG_PROMPT,
    RunningGateway,
    start_gateway,
    tiny_model,
)

KVGATE = str(Path(sys.executable).parent / "kvgate")
OTHER = "A different preamble that belongs to tenant b alone and spans a few blocks of text."


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    # The Admin service on a listener of its own, as the deploy examples run it.
    running = start_gateway(tiny_model(tmp_path_factory.mktemp("tiny") / "model"),
                            admin_listener=True)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(autouse=True)
def _no_kvgate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("KVGATE_API_KEY", "KVGATE_API_KEYS", "KVGATE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # no data/dev-admin-key of a `make serve` in the checkout


def _admin(gateway: RunningGateway, command: str, *args: str, key: str | None = ADMIN_KEY,
           ) -> list[str]:
    argv = ["admin", command, *args, "--port", str(gateway.port),
            "--admin-port", str(gateway.server.admin_port)]
    return [*argv, "--admin-key", key] if key is not None else argv


def _json(capsys: pytest.CaptureFixture[str]) -> object:
    return json.loads(capsys.readouterr().out)


def test_stats_ls_evict_quota_flush_round_trip(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
) -> None:
    gateway.client(KEY_A).warm(LONG_PROMPT)
    gateway.client(KEY_B).warm(OTHER)

    assert main(_admin(gateway, "stats", "--json")) == 0
    stats = _json(capsys)
    assert isinstance(stats, dict) and stats["num_blocks"] > 0
    device = next(t for t in stats["tiers"] if t["name"] == "device")
    assert device["num_blocks"] == stats["num_blocks"] and device["used_bytes"] > 0
    assert stats["engine"]["route"] == "batched" and stats["engine"]["steps"] > 0
    assert stats["engine"]["prefill_tokens"] > 0
    assert (stats["engine"]["device"], stats["engine"]["dtype"]) == ("cpu", "float32")
    assert main(_admin(gateway, "stats")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("engine route batched (start-up probe: ")
    assert ") on cpu in float32; " in lines[1]
    assert lines[2].split()[:3] == ["tier", "blocks", "used"]

    assert main(_admin(gateway, "ls", "--json")) == 0
    listed = _json(capsys)
    assert isinstance(listed, list)
    assert {p["tenant"] for p in listed} == {"tenant-a", "tenant-b"}
    assert main(_admin(gateway, "ls", "--tenant", "tenant-b")) == 0
    assert "tenant-b" in capsys.readouterr().out

    a_blocks = sum(p["num_blocks"] for p in listed if p["tenant"] == "tenant-a")
    assert main(_admin(gateway, "evict", "--tenant", "tenant-a", "--yes", "--json")) == 0
    evicted = _json(capsys)
    assert isinstance(evicted, dict) and evicted["num_blocks"] == a_blocks
    assert evicted["bytes_by_tier"]["device"] > 0
    assert gateway.client(KEY_A).lookup(LONG_PROMPT).cached_tokens == 0
    assert gateway.client(KEY_B).lookup(OTHER).cached_tokens > 0

    assert main(_admin(gateway, "quota", "tenant-b", "2GiB", "--json")) == 0
    assert _json(capsys) == {"tenant": "tenant-b", "num_bytes": 2 << 30}
    assert main(_admin(gateway, "quota", "tenant-b", "none")) == 0
    assert capsys.readouterr().out == "removed the quota of tenant-b\n"

    assert main(_admin(gateway, "flush", "--yes")) == 0
    out = capsys.readouterr().out
    assert out.startswith("freed ") and "device" in out
    assert gateway.client(KEY_B).lookup(OTHER).cached_tokens == 0
    assert main(_admin(gateway, "ls")) == 0
    assert capsys.readouterr().out == "no cached prefixes\n"


def test_pin_and_unpin_flip_the_flag_that_ls_shows(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
) -> None:
    gateway.client(KEY_A).warm(LONG_PROMPT)
    num_blocks = gateway.client(KEY_A).lookup(LONG_PROMPT).num_prompt_blocks
    assert main(_admin(gateway, "pin", LONG_PROMPT, "--raw", "--tenant", "tenant-a",
                       "--json")) == 0
    assert num_blocks > 0 and _json(capsys) == {"num_blocks": num_blocks}
    assert main(_admin(gateway, "ls", "--tenant", "tenant-a", "--json")) == 0
    listed = _json(capsys)
    assert isinstance(listed, list) and [p["is_pinned"] for p in listed] == [True]
    assert main(_admin(gateway, "unpin", LONG_PROMPT, "--raw", "--tenant", "tenant-a")) == 0
    assert capsys.readouterr().out == f"unpinned {num_blocks} blocks\n"
    assert main(_admin(gateway, "ls", "--tenant", "tenant-a", "--json")) == 0
    listed = _json(capsys)
    assert isinstance(listed, list) and [p["is_pinned"] for p in listed] == [False]
    assert main(_admin(gateway, "evict", "--older-than", "0s", "--yes")) == 0
    assert capsys.readouterr().out.startswith("freed ")
    assert gateway.client(KEY_A).lookup(LONG_PROMPT).cached_tokens == 0


def test_evict_without_yes_and_without_a_tty_refuses_and_changes_nothing(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway.client(KEY_A).warm(LONG_PROMPT)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # not a TTY: never read
    assert main(_admin(gateway, "evict", "--all")) == 2
    assert "stdin is not a terminal; pass --yes" in capsys.readouterr().err
    assert main(_admin(gateway, "flush")) == 2
    assert gateway.client(KEY_A).lookup(LONG_PROMPT).cached_tokens > 0
    assert main(_admin(gateway, "evict", "--yes")) == 2
    assert "name what to evict" in capsys.readouterr().err
    assert main(_admin(gateway, "evict", "--all", "--tier", "host", "--yes")) == 2
    assert main(_admin(gateway, "evict", "--older-than", "soon", "--yes")) == 2
    assert "is not a duration" in capsys.readouterr().err


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_evict_on_a_tty_asks_and_no_keeps_everything(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway.client(KEY_A).warm(LONG_PROMPT)
    monkeypatch.setattr(sys, "stdin", _Tty("n\n"))
    assert main(_admin(gateway, "evict", "--tenant", "tenant-a")) == 2
    err = capsys.readouterr().err
    assert "Evict blocks with --tenant 'tenant-a'? [y/N]" in err and "not confirmed" in err
    assert gateway.client(KEY_A).lookup(LONG_PROMPT).cached_tokens > 0
    monkeypatch.setattr(sys, "stdin", _Tty("y\n"))
    assert main(_admin(gateway, "evict", "--tenant", "tenant-a")) == 0
    assert "freed " in capsys.readouterr().out
    assert gateway.client(KEY_A).lookup(LONG_PROMPT).cached_tokens == 0


def test_a_tenant_key_or_no_key_is_refused_and_nothing_changes(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    gateway.client(KEY_A).warm(LONG_PROMPT)
    assert main(_admin(gateway, "flush", "--yes", key=KEY_A)) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert main(_admin(gateway, "stats", key="not-a-key-0123456789abcdef")) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert main(_admin(gateway, "stats", key=None)) == 2
    assert "no admin key" in capsys.readouterr().err
    config = tmp_path / "kvgate.toml"
    config.write_text('[[admin_keys]]\nname = "ops"\nkey_blake2b = "00"\n', encoding="utf-8")
    assert main([*_admin(gateway, "stats", key=None), "--config", str(config)]) == 2
    assert "digests cannot be sent" in capsys.readouterr().err
    assert gateway.client(KEY_A).lookup(LONG_PROMPT).cached_tokens > 0


def test_the_installed_command_takes_the_key_from_env_or_config(
    gateway: RunningGateway, tmp_path: Path,
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    run = subprocess.run(
        [KVGATE, "admin", "stats", "--json", "--port", str(gateway.server.admin_port)],
        env={**env, "KVGATE_ADMIN_KEY": ADMIN_KEY}, capture_output=True, text=True,
        timeout=60, check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "tiers" in json.loads(run.stdout)
    config = tmp_path / "kvgate.toml"
    config.write_text(f'[[admin_keys]]\nname = "ops"\nkey = "{ADMIN_KEY}"\n', encoding="utf-8")
    run = subprocess.run(
        [KVGATE, "admin", "quota", "tenant-a", "500MB", "--port", str(gateway.server.admin_port),
         "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "quota of tenant-a: 476.8 MiB\n"


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "15m", "1h", "2d", "0.5h")] == \
        [90.0, 90.0, 900.0, 3600.0, 172800.0, 1800.0]
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("1w")


def test_the_main_port_alone_says_where_the_admin_service_is(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["admin", "stats", "--port", str(gateway.port), "--admin-key", ADMIN_KEY]
    assert main(argv) == 1
    assert "--admin-port" in capsys.readouterr().err


TAIL_ONE = " First question: how many blocks does a long prompt about caches fill up today?"
TAIL_TWO = " Second question: which tier holds the blocks that were evicted from the device?"


def _all_keys(gateway: RunningGateway) -> list[str]:
    assert gateway.opened is not None
    placement = gateway.opened.cache.placement
    with placement.locked():
        return [r.key.hex() for r in placement.index.records()]


def test_evict_key_as_ls_shows_it_evicts_the_prompts_whole_chain_and_no_more(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(_admin(gateway, "flush", "--yes")) in (0, 3)
    client = gateway.client(KEY_A)
    client.warm(LONG_PROMPT + TAIL_ONE)
    client.warm(LONG_PROMPT + TAIL_TWO)
    shared = client.lookup(LONG_PROMPT).cached_tokens
    two = client.lookup(LONG_PROMPT + TAIL_TWO).cached_tokens
    assert 0 < shared < two == client.lookup(LONG_PROMPT + TAIL_ONE).cached_tokens
    capsys.readouterr()
    assert main(_admin(gateway, "ls", "--json")) == 0
    listed = _json(capsys)
    assert isinstance(listed, list) and len(listed) == 2
    one = listed[0]
    assert main(_admin(gateway, "ls")) == 0
    shown = [line.split()[0] for line in capsys.readouterr().out.splitlines()[2:]]
    assert one["key_hex"][:16] in shown

    num_blocks_before = len(_all_keys(gateway))
    assert main(_admin(gateway, "evict", "--key", one["key_hex"][:16].upper(), "--yes",
                       "--json")) == 0
    evicted = _json(capsys)
    # The prompt's own blocks went (those after the part both prompts share), nothing else.
    own_blocks = one["num_blocks"] - shared // 16
    assert isinstance(evicted, dict) and evicted["num_blocks"] == own_blocks > 1
    assert len(_all_keys(gateway)) == num_blocks_before - own_blocks
    assert sorted(client.lookup(LONG_PROMPT + tail).cached_tokens
                  for tail in (TAIL_ONE, TAIL_TWO)) == [shared, two]

    # The other prompt alone: its whole chain goes, shared blocks included.
    assert main(_admin(gateway, "ls", "--json")) == 0
    remaining = _json(capsys)
    assert isinstance(remaining, list) and len(remaining) == 1
    other = remaining[0]
    assert main(_admin(gateway, "evict", "--key", other["key_hex"][:7], "--yes")) == 0
    assert capsys.readouterr().out.startswith(f"freed {other['num_blocks']} blocks\n")
    assert _all_keys(gateway) == []
    assert client.lookup(LONG_PROMPT).cached_tokens == 0


def test_an_unknown_ambiguous_or_bad_key_is_an_error_that_says_why(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
) -> None:
    gateway.client(KEY_A).warm(LONG_PROMPT + TAIL_ONE)
    gateway.client(KEY_B).warm(OTHER)
    for n in range(1, 10):  # 17 keys: two of them begin with the same hex digit
        if len(_all_keys(gateway)) > 16:
            break
        gateway.client(KEY_B).warm(f"{n} " + OTHER)
    keys = _all_keys(gateway)
    unknown = next(c + d for c in "0123456789abcdef" for d in "0123456789abcdef"
                   if not any(k.startswith(c + d) for k in keys))
    assert main(_admin(gateway, "evict", "--key", unknown, "--yes")) == 3
    err = capsys.readouterr().err
    assert f"nothing changed: no cached block's key begins with '{unknown}'" in err
    assert "kvgate admin ls" in err
    # Two keys that begin alike: their common beginning names neither.
    pairs = sorted(keys)
    common = max((os.path.commonprefix([a, b]) for a, b in zip(pairs, pairs[1:], strict=False)),
                 key=len)
    assert common
    assert main(_admin(gateway, "evict", "--key", common, "--yes")) == 1
    assert f"key '{common}' is ambiguous: " in capsys.readouterr().err
    assert main(_admin(gateway, "evict", "--key", "xyz", "--yes")) == 1
    assert "key_hex must be hex digits" in capsys.readouterr().err
    assert sorted(_all_keys(gateway)) == sorted(keys)


def test_evict_with_a_prefix_longer_than_a_prompt_fails_in_one_line_that_names_the_limit(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
) -> None:
    most = LimitSettings().max_prompt_chars
    prefix = "You are a helpful assistant. " * (most // 29 + 1)
    assert main(_admin(gateway, "evict", "--tenant", "tenant-a", "--prefix", prefix,
                       "--yes")) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1
    assert (f"prefix_text has {len(prefix)} characters; a prefix is bounded like a prompt: "
            f"send at most {most} (limits.max_prompt_chars)") in captured.err
    assert "helpful assistant" not in captured.err + captured.out


def test_admin_commands_that_change_nothing_say_why_and_exit_3(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
) -> None:
    gateway.client(KEY_A).warm(LONG_PROMPT)
    capsys.readouterr()
    part = LONG_PROMPT.split(".")[0]
    assert main(_admin(gateway, "evict", "--tenant", "tenant-a", "--prefix", part,
                       "--yes")) == 3
    captured = capsys.readouterr()
    assert captured.out == "freed 0 blocks\n"
    assert "nothing changed:" in captured.err and "part of a prompt selects nothing" in captured.err
    assert main(_admin(gateway, "pin", LONG_PROMPT, "--raw")) == 3
    assert "the admin key's own scope (give --tenant NAME or --shared)" in \
        capsys.readouterr().err
    assert main(_admin(gateway, "unpin", LONG_PROMPT, "--raw", "--tenant", "tenant-a")) == 3
    assert "no pinned full block" in capsys.readouterr().err
    assert main(_admin(gateway, "quota", "nobody", "1GiB")) == 3
    err = capsys.readouterr().err
    assert "no tenant 'nobody'" in err and "tenant-a" in err
    assert gateway.client(KEY_A).lookup(LONG_PROMPT).cached_tokens > 0
    assert main(_admin(gateway, "flush", "--yes")) == 0
    capsys.readouterr()
    assert main(_admin(gateway, "flush", "--yes")) == 3
    assert "the cache holds no block" in capsys.readouterr().err
    assert main(_admin(gateway, "evict", "--all", "--yes")) == 3


def test_the_help_of_every_admin_command_documents_the_exit_codes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("evict", "pin", "quota", "flush"):
        with pytest.raises(SystemExit):
            main(["admin", command, "--help"])
        assert "3 nothing to change" in " ".join(capsys.readouterr().out.split())


def test_admin_on_this_machine_uses_the_dev_admin_key_of_the_data_dir(
    gateway: RunningGateway, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "dev-admin-key").write_text(ADMIN_KEY + "\n", encoding="ascii")
    assert main(_admin(gateway, "stats", "--json", key=None)) == 0  # ./data, the default
    stats = _json(capsys)
    assert isinstance(stats, dict) and "tiers" in stats
    elsewhere = tmp_path / "elsewhere"
    assert main([*_admin(gateway, "stats", key=None), "--data-dir", str(elsewhere)]) == 2
    assert "DATA_DIR/dev-admin-key" in capsys.readouterr().err
    # Never sent to a gateway on another machine.
    assert main(["admin", "stats", "--host", "192.0.2.1", "--timeout", "1",
                 "--data-dir", str(data)]) == 2
    assert "no admin key" in capsys.readouterr().err
