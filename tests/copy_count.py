"""Counting the copies torch runs: what a GPU launches a kernel for, at least, so that a test
on the CPU can hold a path to its number of launches."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CountCopies(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Within ``with CountCopies() as counted:``, ``counted.copies`` counts the tensor copies
    (``copy_`` and ``to(copy=True)``) run."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            self.copies += 1
        return func(*args, **(kwargs or {}))
