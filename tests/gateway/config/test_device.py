"""``--device auto|cpu|cuda[:N]`` (``[server] device``): checked with the configuration, resolved
against the machine, and where the model and the cache's memory tiers then live (issue 11,
item 3). The CUDA cases are marked ``gpu`` (``make test-gpu``).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from gateway.cache.operations.factory import CacheConfig, open_cache
from gateway.config.device import DeviceError, resolve_device
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError, ServeConfig
from gateway.service.assembly import serve
from gateway.service.server import ServeError
from tiers.memory import DeviceStore, HostStore
from tiers.payload import KVLayout

LAYOUT = KVLayout(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


def test_the_device_flag_reaches_the_configuration() -> None:
    assert load_serve_config(env={}, overrides={"device": "cuda:1"}).device == "cuda:1"
    assert load_serve_config(env={}).device == "auto"


def test_a_malformed_device_is_listed_with_the_choices() -> None:
    with pytest.raises(ConfigError) as error:
        load_serve_config(env={}, overrides={"device": "gpu0"})
    assert "server.device must be auto, cpu, cuda or cuda:N, got 'gpu0'" in str(error.value)


@no_gpu
def test_auto_is_the_cpu_on_a_machine_without_a_gpu() -> None:
    assert resolve_device("auto") == torch.device("cpu")


@no_gpu
def test_asking_for_cuda_without_one_says_what_torch_sees_and_what_to_do() -> None:
    with pytest.raises(DeviceError) as error:
        resolve_device("cuda")
    assert f"torch {torch.__version__} sees no CUDA device" in str(error.value)
    assert "--device cpu" in str(error.value)


@no_gpu
def test_serve_with_a_missing_gpu_stops_with_that_message(tmp_path: Path) -> None:
    config = ServeConfig(host="127.0.0.1", port=0, data_dir=tmp_path, device="cuda:0")
    with pytest.raises(ServeError, match="sees no CUDA device"):
        serve(config, env={}, stop_requested=threading.Event(), announce=lambda line: None)


def test_the_memory_tiers_live_on_the_cpu_beside_a_cpu_model(tmp_path: Path) -> None:
    opened = open_cache(CacheConfig(block_tokens=2, device_bytes=1 << 20, host_bytes=1 << 20),
                        layout=LAYOUT, deployment_secret=b"s" * 32, device="cpu")
    try:
        device, host = (opened.hierarchy.store(name) for name in ("device", "host"))
        assert isinstance(device, DeviceStore) and device.device == torch.device("cpu")
        assert isinstance(host, HostStore) and not host.is_pinned
        assert host.serve_device == torch.device("cpu")
    finally:
        opened.close()


@pytest.mark.gpu
def test_cuda_n_resolves_to_that_gpu_and_a_missing_one_is_refused() -> None:
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match="CUDA device"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.gpu
def test_beside_a_gpu_model_the_device_tier_is_on_it_and_the_host_tier_pinned() -> None:
    opened = open_cache(CacheConfig(block_tokens=2, device_bytes=1 << 20, host_bytes=1 << 20),
                        layout=LAYOUT, deployment_secret=b"s" * 32, device="cuda:0")
    try:
        device, host = (opened.hierarchy.store(name) for name in ("device", "host"))
        assert isinstance(device, DeviceStore) and device.device == torch.device("cuda", 0)
        assert isinstance(host, HostStore) and host.is_pinned
        assert host.serve_device == torch.device("cuda", 0)
    finally:
        opened.close()
