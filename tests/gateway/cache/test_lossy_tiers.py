"""``[cache] quantize``: validated at the edge, every problem at once, one format per deployment,
and the opened cache's lower tiers keeping copies of that format only (docs/design.md, "Lossy
tiers"). What a request then reads: tests/gateway/engine/test_lossy_engine.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.cache.lossy_tiers import lossy_tiers
from gateway.cache.operations.factory import CacheConfig, open_cache
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError
from tiers.payload import KVLayout


def test_every_tier_is_exact_by_default() -> None:
    assert dict(CacheConfig().quantize) == {}
    assert lossy_tiers(CacheConfig(quantize={"host": "none", "disk": "none"}).quantize) == {}


def test_the_lower_tiers_accept_int8_and_fp8(tmp_path: Path) -> None:
    tiers: dict[str, Any] = {"disk_bytes": 1 << 30, "disk_path": tmp_path,
                             "redis_url": "redis://127.0.0.1:1/0"}
    config = CacheConfig(quantize={"host": "int8", "disk": "int8", "redis": "int8"}, **tiers)
    assert lossy_tiers(config.quantize) == {"host": "int8", "disk": "int8", "redis": "int8"}
    assert lossy_tiers(CacheConfig(quantize={"disk": "fp8", "host": "none"},
                                   **tiers).quantize) == {"disk": "fp8"}
    with pytest.raises(TypeError):
        config.quantize["disk"] = "none"  # type: ignore[index]


def test_the_lossy_tiers_must_share_one_format() -> None:
    with pytest.raises(ValueError, match="quantize names fp8 and int8: the lossy tiers must "
                                         "share one format"):
        CacheConfig(quantize={"disk": "int8", "redis": "fp8"})


@pytest.mark.parametrize(("table", "message"), [
    ({"device": "int8"}, "quantize names the device tier, which always holds the K/V"),
    ({"ssd": "int8"}, "quantize names the tier 'ssd'; quantizable tiers: host, disk, redis"),
    ({"disk": "int4"}, "quantize.disk must be one of 'none', 'int8', 'fp8'; got 'int4'"),
    ({"redis": True}, "quantize.redis must be one of 'none', 'int8', 'fp8'; got True"),
])
def test_a_bad_table_is_refused_with_what_is_allowed(table: dict[str, object],
                                                     message: str) -> None:
    with pytest.raises(ValueError, match="invalid cache configuration") as raised:
        CacheConfig(quantize=table)
    assert message in str(raised.value)


def test_the_loader_lists_quantize_problems_with_the_others(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[cache]\nquantize = "int8"\n\n[engine]\nmax_queue = 0\n', encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        load_serve_config(path, env={})
    message = str(raised.value)
    assert 'cache.quantize: quantize must be a table of tier = format, e.g. { redis = "int8" }' \
        in message
    assert "engine.max_queue must be an integer >= 1" in message


def test_the_loader_accepts_a_lossy_tier(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[cache]\nquantize = { disk = "int8", redis = "none" }\n', encoding="utf-8")
    assert lossy_tiers(load_serve_config(path, env={}).cache.quantize) == {"disk": "int8"}


def test_open_cache_gives_each_lower_tier_its_format() -> None:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
    opened = open_cache(CacheConfig(quantize={"host": "int8"}, device_bytes=1 << 20,
                                    host_bytes=1 << 20),
                        layout=layout, deployment_secret=b"s" * 32)
    try:
        placement = opened.cache.placement
        assert placement.lossy_tiers == ("host",)
        assert opened.cache.lossy_format == "int8"
        assert opened.codec.quantization is None  # the exact codec, for whoever encodes exact
    finally:
        opened.close()
