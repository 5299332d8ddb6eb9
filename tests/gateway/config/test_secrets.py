"""What the data directory keeps across restarts (``gateway.config.secrets``): the deployment
secret and the development key, created private and once, then reused."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from gateway.config.secrets import deployment_secret, dev_api_key, read_or_create_private
from gateway.config.settings import ConfigError, ServeConfig


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_secret_is_created_once_private_and_reused(tmp_path: Path) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    secret = deployment_secret(config, {})
    assert len(secret) == 32
    assert mode_of(config.secret_path) == 0o600
    assert mode_of(config.data_dir) == 0o700
    assert deployment_secret(config, {}) == secret
    assert list(config.data_dir.iterdir()) == [config.secret_path]  # no temp files left


def test_the_secret_can_come_from_the_environment(tmp_path: Path) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    value = bytes(range(24))
    assert deployment_secret(config, {"KVGATE_DEPLOYMENT_SECRET": value.hex()}) == value
    with pytest.raises(ConfigError, match="16 to 64 bytes"):
        deployment_secret(config, {"KVGATE_DEPLOYMENT_SECRET": "abcd"})
    with pytest.raises(ConfigError, match="not hex"):
        deployment_secret(config, {"KVGATE_DEPLOYMENT_SECRET": "xyz"})


def test_a_dev_key_file_that_holds_no_usable_key_is_refused(tmp_path: Path) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    config.data_dir.mkdir(mode=0o700)
    config.dev_key_path.write_text("short\n")
    config.dev_key_path.chmod(0o600)
    with pytest.raises(ConfigError, match="delete the file to get a new one"):
        dev_api_key(config)


def test_processes_starting_at_once_agree_on_one_value(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    barrier = threading.Barrier(4)
    values: list[str] = []

    def make() -> str:
        return os.urandom(8).hex()

    def start() -> None:
        barrier.wait()
        values.append(read_or_create_private(path, make))

    threads = [threading.Thread(target=start) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(values)) == 1 and len(values) == 4
    assert list(tmp_path.iterdir()) == [path]


def test_a_secret_with_little_entropy_is_refused(tmp_path: Path) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    for weak in ("00" * 32, "ab" * 24, "0102" * 16):
        with pytest.raises(ConfigError, match="too little entropy"):
            deployment_secret(config, {"KVGATE_DEPLOYMENT_SECRET": weak})


def test_the_deploy_examples_placeholder_secret_is_refused(tmp_path: Path) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    with pytest.raises(ConfigError, match="not hex"):
        deployment_secret(config, {"KVGATE_DEPLOYMENT_SECRET": "REPLACE-with-64-hex-digits"})


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_a_secret_file_open_to_other_users_is_refused_not_warned(tmp_path: Path,
                                                                 mode: int) -> None:
    path = tmp_path / "secret"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(mode)
    config = ServeConfig(data_dir=tmp_path / "data", secret_file=path)
    with pytest.raises(ConfigError, match=f"mode {mode:o}.*chmod 600"):
        deployment_secret(config, {})
    path.chmod(0o600)
    assert len(deployment_secret(config, {})) == 32


def test_a_dev_key_file_open_to_other_users_is_refused(tmp_path: Path) -> None:
    config = ServeConfig(data_dir=tmp_path / "data")
    key = dev_api_key(config)
    config.dev_key_path.chmod(0o644)
    with pytest.raises(ConfigError, match="open to other users"):
        dev_api_key(config)
    config.dev_key_path.chmod(0o600)
    assert dev_api_key(config) == key
