"""Where and in what a benchmark computes: ``--device`` and ``--dtype`` of ``kvgate bench``.

A benchmark that puts kvgate beside a reference is only fair when both run on the same device in
the same dtype: a kvgate-on-GPU row beside an HF-on-CPU row measures the hardware, not the
cache. So every bench command that loads a model or spawns a server resolves the two settings
once, with the very code ``kvgate serve`` uses (``gateway.config.device``,
``gateway.config.dtype``: ``auto`` is the first GPU if torch sees one, else the CPU; bfloat16 on a
GPU, float32 on the CPU), hands the result to its in-process references and writes it into the
configuration of the servers it spawns (``gateway.bench.spawn``, ``gateway.bench.peer_serve``).

CUDA runs kernels asynchronously: a clock read right after a launch measures the launch, not
the work. ``BenchNumerics.clock`` waits for the device before it reads the clock, so a timed
section that starts and ends with it measures the GPU work inside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from gateway.config.device import resolve_device
from gateway.config.dtype import resolve_dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchNumerics:
    """The device and dtype a benchmark's models, tensors and spawned servers use."""

    device: torch.device
    dtype: torch.dtype

    @property
    def device_text(self) -> str:
        """The device as ``--device`` spells it (``cpu``, ``cuda:0``)."""
        return str(self.device)

    @property
    def dtype_name(self) -> str:
        """The dtype as ``--dtype`` spells it (``float32``, ``bfloat16``)."""
        return str(self.dtype).removeprefix("torch.")

    def describe(self) -> str:
        """For report headers: ``on cuda:0 in bfloat16``."""
        return f"on {self.device_text} in {self.dtype_name}"

    def synchronize(self) -> None:
        """Wait until the device has done the work queued so far (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def clock(self) -> float:
        """``time.perf_counter()`` once the work queued on the device is done."""
        self.synchronize()
        return time.perf_counter()


def resolve_numerics(device: str = "auto", dtype: str = "auto") -> BenchNumerics:
    """The device and dtype these settings name on this machine, as ``kvgate serve`` resolves
    them.

    Raises:
        gateway.config.device.DeviceError: a malformed device, or one this machine lacks.
        gateway.config.dtype.DtypeError: a malformed dtype.
    """
    resolved = resolve_device(device)
    return BenchNumerics(device=resolved, dtype=resolve_dtype(dtype, resolved))
