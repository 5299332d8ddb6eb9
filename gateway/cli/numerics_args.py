"""``--device`` and ``--dtype`` of the ``kvgate bench`` commands that run a model.

Checked with the same code as ``kvgate serve``'s own flags (``gateway.config.device``,
``gateway.config.dtype``), in two steps as there: a malformed value is an argparse error (exit
status 2, the choices in the message) before anything runs; a well-formed device this machine
lacks (``cuda`` on a CPU build of torch, ``cuda:3`` on a one-GPU machine) is found when torch
resolves it, first thing, and is a usage error too (``resolve_bench_numerics``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from gateway.cli.common import EXIT_USAGE
from gateway.config.device import DEVICE_CHOICES, device_problem
from gateway.config.dtype import DTYPE_CHOICES, dtype_problem

if TYPE_CHECKING:
    from gateway.bench.numerics import BenchNumerics


def _setting(problem: Callable[[object], str | None], choices: str) -> Callable[[str], str]:
    """An argparse ``type`` that returns ``text`` when ``problem`` finds none in it, and raises
    ``argparse.ArgumentTypeError`` listing ``choices`` otherwise."""
    def check(text: str) -> str:
        if problem(text) is not None:
            raise argparse.ArgumentTypeError(f"must be {choices}, got {text!r}")
        return text
    return check


device_setting = _setting(device_problem, DEVICE_CHOICES)
"""``text`` when it is a device setting (argparse ``type``)."""

dtype_setting = _setting(dtype_problem, DTYPE_CHOICES)
"""``text`` when it is a dtype setting (argparse ``type``)."""


def add_numerics_arguments(parser: argparse.ArgumentParser, *, what: str) -> None:
    """``--device`` and ``--dtype`` (default ``auto``, as for ``kvgate serve``); ``what`` says
    what runs there."""
    parser.add_argument(
        "--device", type=device_setting, default="auto",
        help=f"where {what} run: auto (the first GPU if torch sees one, else the CPU; the "
             "default), cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", type=dtype_setting, default="auto",
        help="what they compute in: auto (bfloat16 on a GPU, float32 on the CPU; the "
             "default), float32, bfloat16 or float16")


def resolve_bench_numerics(args: argparse.Namespace, *, command: str,
                           err: TextIO) -> BenchNumerics | int:
    """The device and dtype of ``args`` on this machine, or ``EXIT_USAGE`` after saying on
    ``err`` why this machine cannot run them (``command``: e.g. ``kvgate bench ttft``)."""
    from gateway.bench.numerics import resolve_numerics
    from gateway.config.device import DeviceError
    from gateway.config.dtype import DtypeError

    try:
        return resolve_numerics(args.device, args.dtype)
    except (DeviceError, DtypeError) as exc:
        err.write(f"{command}: {exc}\n")
        return EXIT_USAGE
