"""Where and in what a benchmark computes (``gateway.bench.numerics``): resolved as ``kvgate
serve`` resolves ``--device`` and ``--dtype``, and spelled as those flags spell it, for the
report headers and the servers a benchmark spawns."""

from __future__ import annotations

import pytest
import torch

from gateway.bench.numerics import resolve_numerics
from gateway.config.device import DeviceError
from gateway.config.dtype import DtypeError

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@no_gpu
def test_auto_is_the_cpu_in_float32_without_a_gpu() -> None:
    numerics = resolve_numerics()
    assert (numerics.device, numerics.dtype) == (torch.device("cpu"), torch.float32)
    assert numerics.describe() == "on cpu in float32"


def test_an_explicit_dtype_is_kept_and_spelled_as_the_flag_spells_it() -> None:
    numerics = resolve_numerics("cpu", "bfloat16")
    assert numerics.dtype == torch.bfloat16
    assert (numerics.device_text, numerics.dtype_name) == ("cpu", "bfloat16")
    assert numerics.describe() == "on cpu in bfloat16"


def test_the_clock_advances_on_the_cpu() -> None:
    numerics = resolve_numerics("cpu", "float32")
    began = numerics.clock()
    assert numerics.clock() >= began


def test_malformed_settings_raise_the_errors_of_serve() -> None:
    with pytest.raises(DeviceError, match="got 'gpu'"):
        resolve_numerics("gpu", "auto")
    with pytest.raises(DtypeError, match="got 'half'"):
        resolve_numerics("cpu", "half")


@pytest.mark.gpu
def test_auto_is_the_first_gpu_in_bfloat16_on_a_gpu() -> None:
    numerics = resolve_numerics()
    assert numerics.device_text == "cuda:0" and numerics.dtype_name == "bfloat16"
    assert numerics.describe() == "on cuda:0 in bfloat16"
