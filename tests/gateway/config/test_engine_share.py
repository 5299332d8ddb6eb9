"""``[engine] max_kv_share_per_tenant``: read, defaulted, and refused outside (0, 1]."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError, EngineSettings


def test_the_kv_share_defaults_to_half_and_is_read(tmp_path: Path) -> None:
    assert load_serve_config(None, env={}).engine.max_kv_share_per_tenant == 0.5
    path = tmp_path / "kvgate.toml"
    path.write_text("[engine]\nmax_kv_share_per_tenant = 1\n", encoding="utf-8")
    assert load_serve_config(path, env={}).engine.max_kv_share_per_tenant == 1


@pytest.mark.parametrize("share", [0, -0.5, 1.5, float("nan"), "half", True])
def test_a_kv_share_outside_zero_to_one_is_refused_naming_it(share: object) -> None:
    problems = EngineSettings(max_kv_share_per_tenant=share).problems()  # type: ignore[arg-type]
    assert len(problems) == 1 and "engine.max_kv_share_per_tenant" in problems[0]


def test_a_bad_kv_share_in_a_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text("[engine]\nmax_kv_share_per_tenant = 2.0\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="max_kv_share_per_tenant"):
        load_serve_config(path, env={})
