"""``[engine] prefill_step_tokens``: left out, it follows the model's device (1,024 on a CPU,
8,192 on a GPU, whose steps cost their launches); set, it is kept; nonsense is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.loader import load_serve_config
from gateway.config.settings import EngineSettings
from gateway.engine.settings import EngineConfig


def config_for(settings: EngineSettings, device_type: str) -> EngineConfig:
    return EngineConfig.of(settings, block_tokens=64, max_deadline_s=60.0,
                           device_type=device_type)


@pytest.mark.parametrize(("device_type", "tokens"), [("cpu", 1024), ("cuda", 8192),
                                                     ("mps", 1024)])
def test_left_out_it_follows_the_device(device_type: str, tokens: int) -> None:
    settings = load_serve_config(None, env={}).engine
    assert settings.prefill_step_tokens is None
    config = config_for(settings, device_type)
    assert config.prefill_step_tokens == config.prefill_tokens == tokens
    assert config.schedule_limits(is_serial=False).prefill_step_tokens == tokens
    assert config.search_settings().max_rows == tokens  # the search covers the largest step


def test_set_in_the_file_it_is_kept_on_a_gpu(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text("[engine]\nprefill_step_tokens = 2048\n", encoding="utf-8")
    settings = load_serve_config(path, env={}).engine
    assert config_for(settings, "cuda").prefill_tokens == 2048


@pytest.mark.parametrize("tokens", [0, -1, "many", True])
def test_a_bad_value_is_refused_naming_it(tokens: object) -> None:
    problems = EngineSettings(prefill_step_tokens=tokens).problems()  # type: ignore[arg-type]
    assert len(problems) == 1 and "engine.prefill_step_tokens" in problems[0]
