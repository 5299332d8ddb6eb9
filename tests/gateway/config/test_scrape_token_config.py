"""``[metrics] scrape_token_file`` and ``KVGATE_METRICS_TOKEN(_FILE)``: read like the other
secrets (a file others may read is refused), checked like an API key, kept as a digest; none
set keeps both ``/metrics`` open, as before (issue 44, LOW)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.keys import key_digest
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError

TOKEN = "kvg-scrape-Vq7Lm2Xe9Rb4Tn6Wc1Hs8Jd3"


def _token_file(tmp_path: Path, mode: int = 0o600, text: str = TOKEN) -> Path:
    path = tmp_path / "metrics-token"
    path.write_text(text + "\n", encoding="ascii")
    path.chmod(mode)
    return path


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "kvgate.toml"
    path.write_text(body, encoding="utf-8")
    return path


def test_no_token_configured_leaves_metrics_open() -> None:
    assert load_serve_config(None, env={}).metrics.scrape_token_digest is None


def test_the_token_file_is_kept_as_its_digest(tmp_path: Path) -> None:
    token = _token_file(tmp_path)
    config = load_serve_config(_config(tmp_path, f'[metrics]\nscrape_token_file = "{token}"\n'),
                               env={})
    assert config.metrics.scrape_token_digest == key_digest(TOKEN)


def test_the_environment_token_wins_over_the_file(tmp_path: Path) -> None:
    token = _token_file(tmp_path)
    other = "kvg-scrape-env-Hq3Zt8Wm1Ly6Pc4Rv9Nd2"
    config = load_serve_config(_config(tmp_path, f'[metrics]\nscrape_token_file = "{token}"\n'),
                               env={"KVGATE_METRICS_TOKEN": other})
    assert config.metrics.scrape_token_digest == key_digest(other)


def test_a_token_file_others_may_read_is_refused(tmp_path: Path) -> None:
    token = _token_file(tmp_path, mode=0o644)
    with pytest.raises(ConfigError, match="KVGATE_METRICS_TOKEN_FILE: .*chmod 600"):
        load_serve_config(None, env={"KVGATE_METRICS_TOKEN_FILE": str(token)})


def test_a_guessable_token_is_refused_without_being_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="metrics scrape token") as caught:
        load_serve_config(None, env={"KVGATE_METRICS_TOKEN": "changeme-changeme"})
    assert "changeme-changeme" not in str(caught.value)


def test_a_digest_in_the_file_is_not_a_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="scrape_token_digest is not a setting"):
        load_serve_config(_config(tmp_path, '[metrics]\nscrape_token_digest = "ab"\n'), env={})
