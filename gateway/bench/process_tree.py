"""The processes of a server: its pid and every descendant, read from ``/proc`` (Linux).

A server under test may run its work in child processes (vLLM's engine core is one), so what it
costs -- memory (``gateway.bench.spawn.process_tree_peak_rss``), CPU time
(``gateway.bench.cores_used``) -- is read over the whole tree, not the one pid the bench started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ProcessKey = tuple[int, int]
"""(pid, start time in clock ticks since boot): one process, even after its pid is reused."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessStat:
    """What ``/proc/<pid>/stat`` says of one process, as far as the bench reads it."""

    parent: int
    key: ProcessKey
    cpu_ticks: int
    """utime + stime: clock ticks (``SC_CLK_TCK``) it ran in user and kernel mode, all threads."""


def read_stat(pid: int) -> ProcessStat | None:
    """``pid``'s stat; None when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the
    # last one. Fields after it, numbered from 3: ppid 4, utime 14, stime 15, starttime 22.
    fields = text.rsplit(")", 1)[-1].split()
    try:
        ppid, utime, stime, start = int(fields[1]), int(fields[11]), int(fields[12]), \
            int(fields[19])
    except (IndexError, ValueError):
        return None
    return ProcessStat(parent=ppid, key=(pid, start), cpu_ticks=utime + stime)


def process_tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant of it (from ``/proc``); [] where /proc cannot tell."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        stat = read_stat(int(entry))
        if stat is not None:
            children.setdefault(stat.parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found
