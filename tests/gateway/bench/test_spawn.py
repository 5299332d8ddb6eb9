"""The gateway ``kvgate bench ttft --spawn`` starts (``gateway.bench.spawn``): its generated
configuration is one that ``kvgate serve`` accepts, with the bench's own tenant and admin."""

from __future__ import annotations

from pathlib import Path

from gateway.bench.spawn import SPAWN_TENANT, spawn_config
from gateway.config.loader import load_serve_config

API_KEY = "kvg-bench-Qm3xT8vLp2Zr9Kd4Wn7Y"
ADMIN_KEY = "kvg-bench-admin-Hs5Jq1Bc6Vf0Rt3Ue8Ga"


def test_the_spawned_configuration_is_a_valid_serve_configuration(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(block_tokens=64, device_bytes=1 << 20,
                                 redis_url="redis://127.0.0.1:6399/0", api_key=API_KEY,
                                 admin_key=ADMIN_KEY))
    config = load_serve_config(path, env={}, overrides={"data_dir": tmp_path / "data"})
    assert config.cache.block_tokens == 64
    assert config.cache.device_bytes == 1 << 20
    assert config.cache.redis_url == "redis://127.0.0.1:6399/0"
    assert config.cache.redis_timeout_s == 10.0
    assert config.grpc.shutdown_grace_s == 5.0
    assert sorted((k.principal.tenant, k.principal.is_admin) for k in config.keys) == [
        (SPAWN_TENANT, False), ("bench-admin", True)]


def test_without_redis_the_configuration_names_none(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(block_tokens=256, device_bytes=1 << 20, redis_url=None,
                                 api_key=API_KEY, admin_key=ADMIN_KEY))
    assert load_serve_config(path, env={}).cache.redis_url is None
