"""``[engine] captured_steps``: on by default, read from the file, refused unless a boolean."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError, EngineSettings


def test_captured_steps_are_on_by_default_and_read_from_the_file(tmp_path: Path) -> None:
    assert load_serve_config(None, env={}).engine.captured_steps is True
    path = tmp_path / "kvgate.toml"
    path.write_text("[engine]\ncaptured_steps = false\n", encoding="utf-8")
    assert load_serve_config(path, env={}).engine.captured_steps is False


@pytest.mark.parametrize("value", [1, "yes", None])
def test_a_captured_steps_value_that_is_not_a_boolean_is_refused_naming_it(value: object) -> None:
    problems = EngineSettings(captured_steps=value).problems()  # type: ignore[arg-type]
    assert problems == [f"engine.captured_steps must be true or false, got {value!r}"]


def test_a_bad_captured_steps_in_a_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[engine]\ncaptured_steps = "on"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="captured_steps"):
        load_serve_config(path, env={})
