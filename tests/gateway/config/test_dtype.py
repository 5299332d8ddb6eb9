"""``--dtype auto|float32|bfloat16|float16`` (``[server] dtype``): checked with the configuration
and resolved against the device (issue 14, item 1). ``auto`` on a real GPU is covered by the
``gpu``-marked test in tests/gateway/engine/test_dtype.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from gateway.cli.main import main
from gateway.config.dtype import DtypeError, resolve_dtype
from gateway.config.loader import load_serve_config
from gateway.config.settings import ConfigError, ServeConfig

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # a device object: resolving needs no GPU


def test_the_dtype_is_auto_unless_the_file_or_the_flag_says_otherwise(tmp_path: Path) -> None:
    assert load_serve_config(env={}).dtype == "auto" == ServeConfig().dtype
    path = tmp_path / "kvgate.toml"
    path.write_text('[server]\ndtype = "float16"\n', encoding="utf-8")
    assert load_serve_config(path, env={}).dtype == "float16"
    assert load_serve_config(path, env={}, overrides={"dtype": "bfloat16"}).dtype == "bfloat16"


def test_a_wrong_dtype_is_a_config_error_naming_the_allowed_values() -> None:
    with pytest.raises(ConfigError) as error:
        load_serve_config(env={}, overrides={"dtype": "bf16"})
    assert "server.dtype must be auto, float32, bfloat16 or float16, got 'bf16'" in str(
        error.value)


def test_serve_refuses_a_wrong_dtype_flag_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uvicorn_log = logging.getLogger("uvicorn.error")
    level = uvicorn_log.level  # `serve` quiets it, process-wide; this process goes on
    try:
        assert main(["serve", "--dtype", "fp8", "--data-dir", str(tmp_path)]) == 2
    finally:
        uvicorn_log.setLevel(level)
    assert "server.dtype must be auto, float32, bfloat16 or float16, got 'fp8'" in (
        capsys.readouterr().err)
    assert not any(tmp_path.iterdir())  # nothing was started or written


def test_auto_is_float32_on_the_cpu_and_bfloat16_on_a_gpu() -> None:
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("auto", CUDA) == torch.bfloat16


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_a_named_dtype_is_that_dtype_on_any_device(name: str) -> None:
    assert resolve_dtype(name, CPU) == resolve_dtype(name, CUDA) == getattr(torch, name)


def test_half_precision_on_the_cpu_is_allowed_with_a_warning_that_it_is_slow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.config.dtype"):
        assert resolve_dtype("bfloat16", CPU) == torch.bfloat16
        assert resolve_dtype("float32", CPU) == torch.float32
        assert resolve_dtype("bfloat16", CUDA) == torch.bfloat16
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "--dtype bfloat16 on the CPU"]
    assert "slow" in caplog.records[0].getMessage()


def test_resolving_an_unchecked_value_raises() -> None:
    with pytest.raises(DtypeError, match="got 'float64'"):
        resolve_dtype("float64", CPU)
