"""Machine-fit checks (``gateway.config.fit``): budgets this machine cannot hold are refused
before anything starts, and budgets it can hold pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cache.operations.factory import CacheConfig
from gateway.config.fit import machine_fit_problems, physical_memory_bytes
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError


def test_budgets_larger_than_the_machine_are_refused(tmp_path: Path) -> None:
    memory = physical_memory_bytes()
    assert memory is not None
    path = tmp_path / "kvgate.toml"
    path.write_text(
        "[cache]\n"
        f"host_bytes = {memory + 1}\n"
        f'disk_bytes = "1000000GiB"\n'
        f'disk_path = "{tmp_path / "kv"}"\n'
    )
    with pytest.raises(ConfigError) as excinfo:
        load_serve_config(path, env={})
    message = str(excinfo.value)
    assert "more than this machine's memory" in message
    assert "more than the filesystem" in message


def test_budgets_the_machine_holds_pass(tmp_path: Path) -> None:
    config = CacheConfig(device_bytes=1 << 20, host_bytes=1 << 20, disk_bytes=1 << 20,
                         disk_path=tmp_path / "not" / "yet" / "made")
    assert machine_fit_problems(config) == []
    assert physical_memory_bytes() is not None
