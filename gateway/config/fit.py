"""Machine-fit checks: cache budgets this machine cannot hold are configuration errors.

A budget is a promise the eviction policies keep; one larger than the machine's memory or disk
ends with the OOM killer or a full disk instead of an eviction. Kept apart from the parser
because it asks the machine (``sysconf``, ``statvfs``, and torch for CUDA) rather than the file.
"""

from __future__ import annotations

import os
import shutil

from gateway.cache.config import CacheConfig


def machine_fit_problems(config: CacheConfig) -> list[str]:
    """Budgets this machine cannot hold: memory tiers beyond its RAM, disk beyond its disk.

    A budget is a promise the policies keep; one larger than the machine ends with the OOM
    killer or a full disk instead of an eviction.
    """
    problems = []
    memory = physical_memory_bytes()
    in_ram = config.host_bytes + (0 if _has_cuda() else config.device_bytes)
    if memory is not None and in_ram > memory:
        what = "host_bytes" if _has_cuda() else "device_bytes + host_bytes"
        problems.append(
            f"cache.{what} = {_gib(in_ram)} is more than this machine's memory "
            f"({_gib(memory)}); lower it"
        )
    if config.disk_bytes and config.disk_path is not None:
        existing = config.disk_path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        try:
            total = shutil.disk_usage(existing).total
        except OSError:
            total = None
        if total is not None and config.disk_bytes > total:
            problems.append(
                f"cache.disk_bytes = {_gib(config.disk_bytes)} is more than the filesystem of "
                f"{config.disk_path} holds ({_gib(total)}); lower it"
            )
    return problems


def physical_memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.1f} GiB"
