"""The gateway ``kvgate bench ttft --spawn`` starts (``gateway.bench.spawn``): its generated
configuration is one that ``kvgate serve`` accepts, with the bench's own tenant and admin, on
the bench's device in its dtype -- as is the ``transformers serve`` reference of ``bench load``
(``gateway.bench.peer_serve``)."""

from __future__ import annotations

from pathlib import Path

from gateway.bench.peer_serve import serve_command
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


def test_a_big_model_gets_write_queues_that_hold_its_longest_prefix_twice(
        tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(block_tokens=64, device_bytes=1 << 30, redis_url=None,
                                 api_key=API_KEY, admin_key=ADMIN_KEY))
    assert load_serve_config(path, env={}).cache.write_queue_bytes == 2 << 30


def test_keys_at_the_servers_default_are_left_out_for_an_older_baseline() -> None:
    text = spawn_config(block_tokens=64, device_bytes=1 << 20, redis_url=None,
                        api_key=API_KEY, admin_key=ADMIN_KEY)
    assert "write_queue_bytes" not in text and "skip_slow_tiers" not in text
    assert "[limits]" not in text


def test_a_load_of_more_users_than_the_default_key_admits_raises_its_limit(
        tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(block_tokens=64, device_bytes=1 << 20, redis_url=None,
                                 api_key=API_KEY, admin_key=ADMIN_KEY, calls_per_key=80))
    limits = load_serve_config(path, env={}).limits
    assert limits.max_calls_per_key == 80
    assert limits.max_calls > 80 + limits.max_lookups


def test_a_spawned_gateway_may_load_from_every_tier(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(block_tokens=64, device_bytes=1 << 20, redis_url=None,
                                 api_key=API_KEY, admin_key=ADMIN_KEY, skip_slow_tiers=False))
    assert load_serve_config(path, env={}).cache.skip_slow_tiers is False


def test_the_spawned_server_runs_on_the_benchmarks_device_in_its_dtype(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(block_tokens=64, device_bytes=1 << 20, redis_url=None,
                                 api_key=API_KEY, admin_key=ADMIN_KEY, device="cuda:1",
                                 dtype="bfloat16"))
    config = load_serve_config(path, env={})
    assert (config.device, config.dtype) == ("cuda:1", "bfloat16")


def test_left_unsaid_the_spawned_server_resolves_device_and_dtype_as_serve_does(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(block_tokens=64, device_bytes=1 << 20, redis_url=None,
                                 api_key=API_KEY, admin_key=ADMIN_KEY))
    config = load_serve_config(path, env={})
    assert (config.device, config.dtype) == ("auto", "auto")


def test_the_transformers_serve_reference_runs_on_the_benchmarks_device_in_its_dtype(
    tmp_path: Path,
) -> None:
    command = serve_command(tmp_path / "peers" / "bin" / "python", tmp_path / "model",
                            port=8123, device="cuda:0", dtype="bfloat16")
    assert command[:3] == [str(tmp_path / "peers" / "bin" / "transformers"), "serve",
                           str((tmp_path / "model").resolve())]
    assert command[command.index("--device") + 1] == "cuda:0"
    assert command[command.index("--dtype") + 1] == "bfloat16"
    assert command[command.index("--port") + 1] == "8123"


def test_the_host_tier_is_the_size_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text(spawn_config(block_tokens=64, device_bytes=1 << 20, redis_url=None,
                                 api_key=API_KEY, admin_key=ADMIN_KEY, host_bytes="256MiB"))
    config = load_serve_config(path, env={}, overrides={"data_dir": tmp_path / "data"})
    assert config.cache.host_bytes == 256 << 20
