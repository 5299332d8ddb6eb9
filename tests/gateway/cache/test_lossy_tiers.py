"""``[cache] quantize``: validated at the edge, every problem at once, and refused at start
until the cache core keeps lossy copies apart (docs/design.md, "Lossy tiers")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gateway.cache.factory import CacheConfig, open_cache
from gateway.cache.lossy_tiers import NOT_SERVED, lossy_tiers
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError
from tiers.base import TierConfigError
from tiers.payload import KVLayout


def test_every_tier_is_exact_by_default() -> None:
    assert dict(CacheConfig().quantize) == {}
    assert lossy_tiers(CacheConfig(quantize={"host": "none", "disk": "none"}).quantize) == {}


def test_the_lower_tiers_accept_int8_and_fp8() -> None:
    config = CacheConfig(quantize={"host": "int8", "disk": "int8", "redis": "fp8"})
    assert lossy_tiers(config.quantize) == {"host": "int8", "disk": "int8", "redis": "fp8"}
    with pytest.raises(TypeError):
        config.quantize["disk"] = "none"  # type: ignore[index]


@pytest.mark.parametrize(("table", "message"), [
    ({"device": "int8"}, "quantize names the device tier, which always holds the K/V"),
    ({"ssd": "int8"}, "quantize names the tier 'ssd'; quantizable tiers: host, disk, redis"),
    ({"disk": "int4"}, "quantize.disk must be one of 'none', 'int8', 'fp8'; got 'int4'"),
    ({"redis": True}, "quantize.redis must be one of 'none', 'int8', 'fp8'; got True"),
])
def test_a_bad_table_is_refused_with_what_is_allowed(table: dict[str, object],
                                                     message: str) -> None:
    with pytest.raises(ValueError, match="invalid cache configuration") as raised:
        CacheConfig(quantize=table)  # type: ignore[arg-type]
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


def test_a_lossy_tier_is_refused_at_the_edge_until_it_is_served(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.toml"
    path.write_text('[cache]\nquantize = { disk = "int8", redis = "none" }\n', encoding="utf-8")
    with pytest.raises(ConfigError) as raised:
        load_serve_config(path, env={})
    assert NOT_SERVED in str(raised.value)
    path.write_text('[cache]\nquantize = { disk = "none" }\n', encoding="utf-8")
    assert lossy_tiers(load_serve_config(path, env={}).cache.quantize) == {}


def test_open_cache_refuses_a_lossy_tier_rather_than_serve_it_as_exact() -> None:
    layout = KVLayout(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
    with pytest.raises(TierConfigError, match="does not serve yet"):
        open_cache(CacheConfig(quantize={"host": "int8"}, device_bytes=1 << 20),
                   layout=layout, deployment_secret=b"s" * 32)
