"""``kvgate config example``: the commented example parses, and deploy/ keeps the same text."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.main import main
from gateway.config.example import EXAMPLE_CONFIG
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError, MetricsSettings, ServeConfig

DEPLOY_EXAMPLE = Path(__file__).resolve().parents[3] / "deploy" / "kvgate.example.toml"


def test_config_example_prints_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "example"]) == 0
    out = capsys.readouterr().out
    assert out == EXAMPLE_CONFIG
    assert "[metrics]" in out and "port = 9464" in out


def test_deploy_keeps_the_same_example() -> None:
    assert DEPLOY_EXAMPLE.read_text(encoding="utf-8") == EXAMPLE_CONFIG


def test_the_example_parses_to_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(EXAMPLE_CONFIG, encoding="utf-8")
    config = load_serve_config(path, env={})
    defaults = load_serve_config(None, env={})
    assert config == defaults
    assert config.metrics == MetricsSettings(enabled=False, host="127.0.0.1", port=9464)
    assert ServeConfig().metrics == config.metrics


def test_metrics_section_is_read(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[metrics]\nenabled = true\nhost = "0.0.0.0"\nport = 0\n', encoding="utf-8")
    assert load_serve_config(path, env={}).metrics == MetricsSettings(
        enabled=True, host="0.0.0.0", port=0)


def test_every_metrics_problem_is_listed_at_once(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[metrics]\nenabled = 1\nhost = ""\nport = 70000\nscrape = 5\n\n'
                    '[engine]\nmax_queue = 0\n', encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_serve_config(path, env={})
    message = str(caught.value)
    for expected in (
        "[metrics] has unknown keys ['scrape']",
        "metrics.enabled must be true or false, got 1",
        "metrics.host must be a host name or address, got ''",
        "metrics.port must be 0 to 65535, got 70000",
        "engine.max_queue must be an integer >= 1",
    ):
        assert expected in message
