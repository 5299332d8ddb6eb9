"""``[[cache.tier]]``: the tiers as an ordered list of kinds, each table read by its kind's
record; the old keys read as the same list, with one deprecation line; a list without the device
tier first, or with an unknown kind, refused in one line."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cache.config import CacheConfig
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError
from tiers.kinds.device import DeviceTierConfig
from tiers.kinds.disk import DiskTierConfig
from tiers.kinds.host import HostTierConfig
from tiers.kinds.quantized_host import QuantizedHostTierConfig
from tiers.kinds.remote import RedisTierConfig

GiB = 1 << 30


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> CacheConfig:
    path = tmp_path / "kvgate.toml"
    path.write_text(f'[server]\ndata_dir = "{tmp_path}"\n\n' + text, encoding="utf-8")
    return load_serve_config(path, env=env or {}).cache


def refusal(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as raised:
        load(tmp_path, text)
    return str(raised.value)


LIST = """
[cache]
block_tokens = 32

[[cache.tier]]
kind = "device"
bytes = "1GiB"

[[cache.tier]]
kind = "host"
bytes = "8GiB"

[[cache.tier]]
kind = "disk"
bytes = "16GiB"
fsync = false
"""


def test_the_tiers_are_read_in_their_order_each_by_its_kind(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    config = load(tmp_path, LIST)
    assert config.tiers == (
        DeviceTierConfig(bytes=GiB), HostTierConfig(bytes=8 * GiB),
        DiskTierConfig(bytes=16 * GiB, path=tmp_path / "kv", fsync=False))
    assert config.block_tokens == 32
    assert config.host_bytes == 8 * GiB and config.disk_path == tmp_path / "kv"
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_the_old_keys_read_as_the_same_list_with_one_deprecation_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    old = load(tmp_path, '[cache]\nblock_tokens = 32\ndevice_bytes = "1GiB"\nhost_bytes = "8GiB"\n'
                         'disk_bytes = "16GiB"\ndisk_fsync = false\n')
    assert old == load(tmp_path, LIST)
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 1
    assert "device_bytes, disk_bytes, disk_fsync, host_bytes" in lines[0]
    assert "[[cache.tier]]" in lines[0]


def test_without_either_the_tiers_are_the_old_defaults(tmp_path: Path) -> None:
    assert load(tmp_path, "").tiers == (
        DeviceTierConfig(), HostTierConfig(), DiskTierConfig(bytes=8 * GiB, path=tmp_path / "kv"))


def test_a_lossy_host_and_the_redis_tier(tmp_path: Path) -> None:
    config = load(tmp_path, """
[[cache.tier]]
kind = "device"

[[cache.tier]]
kind = "quantized_host"
bytes = "2GiB"
quantize = "int8"

[[cache.tier]]
kind = "redis"
url = "redis://127.0.0.1:6399/0"
write_bytes_per_s = "64MiB"
quantize = "int8"
""")
    assert config.tiers[1:] == (
        QuantizedHostTierConfig(bytes=2 * GiB, quantize="int8"),
        RedisTierConfig(url="redis://127.0.0.1:6399/0", write_bytes_per_s=64 << 20,
                        quantize="int8"))
    assert dict(config.quantize) == {"host": "int8", "redis": "int8"}
    assert config.redis_url == "redis://127.0.0.1:6399/0"


def test_the_environment_gives_the_redis_tier_its_url_or_adds_it(tmp_path: Path) -> None:
    url = "redis://:pw@127.0.0.1:6399/0"
    added = load(tmp_path, LIST, env={"KVGATE_REDIS_URL": url})
    assert added.tiers[-1] == RedisTierConfig(url=url)
    given = load(tmp_path, LIST + '\n[[cache.tier]]\nkind = "redis"\nurl = "redis://x:1/0"\n'
                                  "timeout_s = 1.0\n", env={"KVGATE_REDIS_URL": url})
    assert given.tiers[-1] == RedisTierConfig(url=url, timeout_s=1.0)


@pytest.mark.parametrize(("tiers", "words"), [
    (["host", "disk"], "the tiers must start with the device tier"),
    (["host", "device"], "the tiers must start with the device tier"),
    (["device", "ssd"], "cache.tier[1]: unknown tier kind 'ssd'; known: device, disk, host, "
                        "quantized_host, redis"),
    (["device", "host", "quantized_host"], "the tiers name the host tier more than once"),
])
def test_a_list_that_omits_or_moves_the_device_tier_or_names_an_unknown_kind_is_refused(
        tmp_path: Path, tiers: list[str], words: str) -> None:
    text = "".join(f'[[cache.tier]]\nkind = "{kind}"\n' for kind in tiers)
    message = refusal(tmp_path, text)
    assert words in message
    assert len([line for line in message.splitlines() if "tier" in line]) == 1, message


def test_the_list_as_a_whole_is_checked_beside_its_tables(tmp_path: Path) -> None:
    message = refusal(tmp_path, '[[cache.tier]]\nkind = "redis"\nurl = "redis://x:1/0"\n\n'
                                '[[cache.tier]]\nkind = "host"\nbytes = "lots"\n')
    assert "cache.tier[1].bytes: 'lots' is not a size" in message
    assert "[[cache.tier]]: the tiers must start with the device tier" in message
    message = refusal(tmp_path, '[[cache.tier]]\nkind = "device"\n\n[[cache.tier]]\n'
                                'kind = "redis"\nurl = "redis://x:1/0"\n\n'
                                '[[cache.tier]]\nkind = "host"\n')
    assert "a remote tier comes after every local one" in message


def test_each_tier_names_its_own_keys_in_its_problems(tmp_path: Path) -> None:
    message = refusal(tmp_path, """
[[cache.tier]]
kind = "device"
bytes = "lots"

[[cache.tier]]
kind = "host"
bytes = 0
colour = "blue"
""")
    assert "cache.tier[0].bytes: 'lots' is not a size" in message
    assert "cache.tier[1] has unknown keys ['colour']" in message


def test_a_tier_record_lists_its_own_problems(tmp_path: Path) -> None:
    message = refusal(tmp_path, '[[cache.tier]]\nkind = "device"\n\n'
                                '[[cache.tier]]\nkind = "redis"\ntimeout_s = 0\n')
    assert "cache.tier[1].url is needed" in message
    assert "cache.tier[1].timeout_s must be a positive number of seconds" in message


def test_the_list_and_the_old_keys_together_are_refused(tmp_path: Path) -> None:
    message = refusal(tmp_path, LIST.replace("block_tokens = 32", "host_bytes = 0"))
    assert "gives the tiers as [[cache.tier]] and as the old keys ['host_bytes']" in message


def test_the_python_keywords_still_describe_the_tiers(tmp_path: Path) -> None:
    config = CacheConfig(device_bytes=GiB, host_bytes=0, disk_bytes=GiB, disk_path=tmp_path)
    assert config.tiers == (DeviceTierConfig(bytes=GiB), DiskTierConfig(bytes=GiB, path=tmp_path))
    assert config.host_bytes == 0 and config.redis_url is None
    with pytest.raises(ValueError, match="host_bytes must be a size > 0"):
        CacheConfig(host_bytes=-1)
    with pytest.raises(ValueError, match="not both"):
        CacheConfig(tiers=(DeviceTierConfig(),), host_bytes=GiB)


def test_reading_a_configuration_imports_no_store_and_no_redis_client() -> None:
    """``gateway.config`` reads the tier records (``tiers.kinds``); the stores, and the Redis
    client they use, are imported only when ``open_cache`` opens them."""
    code = "import sys, gateway.config.loader; print('\\n'.join(sorted(sys.modules)))"
    root = Path(__file__).resolve().parents[3]
    modules = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                             ).stdout.split()
    stores = [m for m in modules if m in STORE_MODULES or m == "redis" or m.startswith("redis.")]
    assert stores == []
    assert "tiers.kinds.registry" in modules


STORE_MODULES = {"tiers.memory", "tiers.quantized_host", "tiers.disk", "tiers.redis_store",
                 "tiers.redis_client", "tiers.redis_events", "tiers.hierarchy", "tiers.codec",
                 "gateway.cache.operations.factory", "gateway.cache.prefix_cache"}
