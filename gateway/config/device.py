"""Where the model runs: ``--device auto|cpu|cuda|cuda:N`` (``[server] device``).

The model and the device tier must live on the same device -- a device tier on the GPU with
the model on the CPU would copy every warm hit back across the bus -- and the host tier is
pinned exactly when that device is a GPU. So there is one setting, resolved once by the
composition root and handed to the model loader and to the cache.

Parsing is checked with the rest of the configuration (``device_problem``, no torch needed);
whether the machine has that device is checked once torch is loaded (``resolve_device``), so
that ``kvgate serve`` can listen, and answer health checks, while it imports torch.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
_CUDA = re.compile(r"^cuda(?::(\d+))?$")


class DeviceError(ValueError):
    """The configured device is not one this machine has; the message says what it has."""


def device_problem(text: object) -> str | None:
    """Why ``text`` is not a device setting (None when it is one)."""
    if not isinstance(text, str) or not (text in ("auto", "cpu") or _CUDA.match(text)):
        return f"server.device must be {DEVICE_CHOICES}, got {text!r}"
    return None


def resolve_device(text: str) -> torch.device:
    """The device ``text`` names on this machine: ``auto`` is the first GPU if torch sees one,
    else the CPU.

    Raises:
        DeviceError: a malformed setting, or a GPU this machine (or this torch build) lacks.
    """
    import torch  # NOTE: here, not at the top: the loader checks settings without torch

    problem = device_problem(text)
    if problem is not None:
        raise DeviceError(problem)
    if text == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = _CUDA.match(text)
    assert match is not None
    index = int(match.group(1) or 0)
    if not torch.cuda.is_available():
        build = torch.__version__
        raise DeviceError(f"--device {text}: torch {build} sees no CUDA device (a CPU build, "
                          "or no GPU/driver); use --device cpu or auto, or install a CUDA "
                          "build of torch (make test-gpu shows how)")
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {text}: this machine has {count} CUDA device(s), "
                          f"cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)
