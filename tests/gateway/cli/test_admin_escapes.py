"""``kvgate admin`` never writes a tenant's terminal escape sequences raw (issue 44, LOW).

A tenant's prompt is the preview ``admin ls`` shows; before the fix its ESC, BEL and C1 bytes
reached the operator's terminal as sent (retitling the window, clearing the screen). A real
gateway (tiny Llama) is started by the module and stopped at its end.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.cli.common import printable, render_table
from gateway.cli.main import main
from tests.gateway.grpc_harness import ADMIN_KEY, KEY_A, RunningGateway, start_gateway, tiny_model

HOSTILE = ("\x1b]0;owned\x07\x1b[2J\x9b31m\u202e You are a helpful assistant; this preamble "
           "spans a few blocks so that it is cached and listed by the admin command.")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningGateway]:
    running = start_gateway(tiny_model(tmp_path_factory.mktemp("tiny") / "model"))
    try:
        yield running
    finally:
        running.stop()


def test_admin_ls_shows_a_tenants_escape_sequences_escaped(
        gateway: RunningGateway, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVGATE_ADMIN_KEY", raising=False)
    gateway.client(KEY_A).warm(HOSTILE)
    assert main(["admin", "ls", "--port", str(gateway.port), "--admin-key", ADMIN_KEY]) == 0
    out = capsys.readouterr().out
    assert "\\x1b]0;owned\\x07\\x1b[2J" in out
    assert all(line.isprintable() for line in out.splitlines())


@pytest.mark.parametrize(("text", "shown"), [
    ("\x1b[31mred\x1b[0m", "\\x1b[31mred\\x1b[0m"),
    ("bell\x07", "bell\\x07"),
    ("c1\x9b2J", "c1\\x9b2J"),
    ("del\x7f", "del\\x7f"),
    ("rtl\u202eexe.txt", "rtl\\u202eexe.txt"),
    ("line\u2028sep", "line\\u2028sep"),
    ("tab\tnewline\n", "tab\\x09newline\\x0a"),
    ("caf\u00e9 \U0001F600", "caf\u00e9 \U0001F600"),
    ("plain \\x1b", "plain \\x1b"),
])
def test_printable_escapes_what_a_terminal_would_act_on_and_keeps_the_rest(
        text: str, shown: str) -> None:
    assert printable(text) == shown
    assert printable(shown) == shown


def test_every_table_cell_is_escaped() -> None:
    table = render_table(["session", "tenant"], [["s\x1b[2J", "t\x07"]])
    assert "\x1b" not in table and "\x07" not in table
    assert "s\\x1b[2J" in table and "t\\x07" in table
