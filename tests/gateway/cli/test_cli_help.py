"""Every command and option of ``kvgate`` says what it is for in ``--help`` (issue 26, item 5).

The test walks the whole argparse tree that ``kvgate`` builds, so that an option added later
without a help text fails here rather than showing a bare ``--flag FLAG`` to an operator.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from gateway.cli.main import build_parser


def _parsers(parser: argparse.ArgumentParser,
             path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def _commands() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return list(_parsers(build_parser(), ("kvgate",)))


def test_every_option_and_argument_of_every_command_has_a_help_text() -> None:
    missing = []
    for path, parser in _commands():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if not action.help or action.help == argparse.SUPPRESS or not action.help.strip():
                missing.append(f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []
    assert len(_commands()) > 15  # the walk reached the nested commands (bench, admin, ...)


def test_every_subcommand_has_a_help_text() -> None:
    missing = []
    for path, parser in _commands():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {choice.dest for choice in action._choices_actions if choice.help}
                missing += [f"{' '.join(path)} {name}" for name in action.choices
                            if name not in helped]
    assert missing == []


def test_every_help_page_renders() -> None:
    """``%(default)s`` and friends expand (a stray ``%`` in a help text raises here)."""
    for path, parser in _commands():
        text = parser.format_help()
        assert text.startswith("usage: " + " ".join(path)), path
