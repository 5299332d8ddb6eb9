"""A ``FileOps`` test double: injected errnos, frozen operations, simulated power loss.

Everything real happens on real files (tests run in ``tmp_path``); this class only adds faults
and remembers what a power loss could take away:

* ``fail(op, errno, on_call=N, times=K)``: the Nth call of ``op`` (counted from when the fault
  is installed) and the K-1 after it raise ``OSError(errno)`` without touching the disk.
* ``pause(op)``: the matching call blocks *before* it runs until the test releases it, and
  tells the test when it got there (``Pause.reached``). Races become deterministic.
* ``delay(op, seconds)``: the matching calls sleep first.
* ``simulate_power_loss()``: the machine stops (every later call raises EIO) and the disk is
  left as a power cut could leave it: directory entries created or renamed in since their
  directory's last fsync are gone, files are cut to a length between their last fsynced size
  and their current size, and whatever survives of the unsynced tail is garbage.

Durability is tracked per file across renames: what was fsynced under the temp name is still
fsynced under the final name. Files this object did not create count as durable.

NOTE: a rename over an existing file that was never made durable by a directory fsync is
modelled as losing the file (a real disk might bring back the old one). The disk tier never
renames over a file it wants to keep, so for it both are a lost block.
"""

from __future__ import annotations

import errno as errno_mod
import os
import random
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from tiers.fileops import RealFileOps

OPS = (
    "mkdir",
    "open_temp",
    "write",
    "fsync",
    "close",
    "replace",
    "fsync_dir",
    "unlink",
    "read",
    "size",
    "scandir",
)

TailMode = Literal["garble", "truncate", "random"]


@dataclass
class _Fault:
    op: str
    errno: int
    on_call: int
    times: int | None
    path_contains: str | None
    num_seen: int = 0

    def fires(self) -> bool:
        self.num_seen += 1
        if self.num_seen < self.on_call:
            return False
        return self.times is None or self.num_seen < self.on_call + self.times


@dataclass
class Pause:
    """One frozen call: the test waits for ``reached``, looks around, then ``release``s it."""

    op: str
    on_call: int
    path_contains: str | None
    reached: threading.Event = field(default_factory=threading.Event)
    proceed: threading.Event = field(default_factory=threading.Event)
    num_seen: int = 0
    is_used: bool = False
    path: str | None = None

    def wait_reached(self, timeout_s: float = 10.0) -> None:
        if not self.reached.wait(timeout_s):
            raise AssertionError(f"no {self.op} call reached the pause within {timeout_s} s")

    def release(self) -> None:
        self.proceed.set()


@dataclass
class _Delay:
    op: str
    seconds: float
    path_contains: str | None


@dataclass
class _FileState:
    synced_size: int


@dataclass
class PowerLossReport:
    """What ``simulate_power_loss`` did to the disk."""

    dropped: list[str] = field(default_factory=list)
    cut: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (kept, had)


class FaultyFileOps(RealFileOps):
    """``RealFileOps`` with injectable faults and power-loss simulation (see module doc)."""

    def __init__(self, *, seed: int = 0, pause_timeout_s: float = 30.0) -> None:
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._pause_timeout_s = pause_timeout_s
        self.calls: Counter[str] = Counter()
        self._faults: list[_Fault] = []
        self._pauses: list[Pause] = []
        self._delays: list[_Delay] = []
        self._fd_to_path: dict[int, str] = {}
        self._files: dict[str, _FileState] = {}
        self._unsynced_entries: dict[str, set[str]] = {}
        self.is_powered_off = False

    # -- test controls -----------------------------------------------------------------------

    def fail(
        self,
        op: str,
        errno: int,
        *,
        on_call: int = 1,
        times: int | None = 1,
        path_contains: str | None = None,
    ) -> None:
        """Raise ``OSError(errno)`` on the ``on_call``-th matching call (and ``times``-1 more;
        ``times=None``: every call from then on, until ``clear``)."""
        _check_op(op)
        with self._lock:
            self._faults.append(_Fault(op, errno, on_call, times, path_contains))

    def pause(self, op: str, *, on_call: int = 1, path_contains: str | None = None) -> Pause:
        """Freeze the ``on_call``-th matching call of ``op`` before it runs."""
        _check_op(op)
        handle = Pause(op=op, on_call=on_call, path_contains=path_contains)
        with self._lock:
            self._pauses.append(handle)
        return handle

    def delay(self, op: str, seconds: float, *, path_contains: str | None = None) -> None:
        _check_op(op)
        with self._lock:
            self._delays.append(_Delay(op, seconds, path_contains))

    def clear(self) -> None:
        """Remove every fault and delay, and release every pause."""
        with self._lock:
            self._faults.clear()
            self._delays.clear()
            pauses, self._pauses = self._pauses, []
        for handle in pauses:
            handle.release()

    def simulate_power_loss(self, *, tail: TailMode = "random") -> PowerLossReport:
        """Cut the power: leave the disk as a crash could, and refuse every later call.

        Args:
            tail: what happens to bytes written but not fsynced: "truncate" (cut to the last
                fsynced size), "garble" (kept at full length, replaced by random bytes), or
                "random" (a random part of it survives, as random bytes).
        """
        report = PowerLossReport()
        with self._lock:
            self.is_powered_off = True
            # Deepest first, so a dropped directory's own entries are handled before it.
            for directory in sorted(self._unsynced_entries, key=len, reverse=True):
                for name in sorted(self._unsynced_entries[directory]):
                    path = os.path.join(directory, name)
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path)
                    elif os.path.lexists(path):
                        os.unlink(path)
                    else:
                        continue
                    report.dropped.append(path)
            for path, state in self._files.items():
                if not os.path.exists(path):
                    continue
                size = os.path.getsize(path)
                if size <= state.synced_size:
                    continue
                if tail == "truncate":
                    keep = state.synced_size
                elif tail == "garble":
                    keep = size
                else:
                    keep = self._rng.randint(state.synced_size, size)
                with open(path, "r+b") as f:
                    f.truncate(keep)
                    f.seek(state.synced_size)
                    f.write(self._rng.randbytes(keep - state.synced_size))
                report.cut[path] = (keep, size)
            self._files.clear()
            self._unsynced_entries.clear()
            self._fd_to_path.clear()
        return report

    # -- FileOps -----------------------------------------------------------------------------

    def mkdir(self, path: str, mode: int) -> None:
        self._enter("mkdir", path)
        with self._lock:
            self._check_power(path)
            super().mkdir(path, mode)
            self._note_entry(path)

    def open_temp(self, directory: str, prefix: str) -> tuple[int, str]:
        self._enter("open_temp", directory)
        with self._lock:
            self._check_power(directory)
            fd, path = super().open_temp(directory, prefix)
            self._fd_to_path[fd] = path
            self._files[path] = _FileState(synced_size=0)
            self._note_entry(path)
            return fd, path

    def write(self, fd: int, data: bytes | bytearray | memoryview) -> None:
        path = self._fd_to_path.get(fd)
        self._enter("write", path)
        with self._lock:
            self._check_power(path)
            super().write(fd, data)

    def fsync(self, fd: int) -> None:
        path = self._fd_to_path.get(fd)
        self._enter("fsync", path)
        with self._lock:
            self._check_power(path)
            super().fsync(fd)
            current = self._fd_to_path.get(fd)
            if current is not None and current in self._files:
                self._files[current].synced_size = os.fstat(fd).st_size

    def close(self, fd: int) -> None:
        path = self._fd_to_path.get(fd)
        try:
            self._enter("close", path)
        finally:
            # The descriptor is always released, as close(2) does even when it reports an error.
            with self._lock:
                self._fd_to_path.pop(fd, None)
                super().close(fd)
        if self.is_powered_off:
            raise OSError(errno_mod.EIO, "simulated power loss", path)

    def replace(self, src: str, dst: str) -> None:
        self._enter("replace", dst)
        with self._lock:
            self._check_power(dst)
            super().replace(src, dst)
            state = self._files.pop(src, None)
            if state is None:
                state = _FileState(synced_size=os.path.getsize(dst))
            self._files[dst] = state
            for fd, path in self._fd_to_path.items():
                if path == src:
                    self._fd_to_path[fd] = dst
            self._forget_entry(src)
            self._note_entry(dst)

    def fsync_dir(self, path: str) -> None:
        self._enter("fsync_dir", path)
        with self._lock:
            self._check_power(path)
            super().fsync_dir(path)
            self._unsynced_entries.pop(os.path.normpath(path), None)

    def unlink(self, path: str) -> None:
        self._enter("unlink", path)
        with self._lock:
            self._check_power(path)
            super().unlink(path)
            self._files.pop(path, None)
            self._forget_entry(path)

    def read(self, path: str, max_bytes: int | None) -> bytes:
        self._enter("read", path)
        with self._lock:
            self._check_power(path)
        return super().read(path, max_bytes)

    def size(self, path: str) -> int:
        self._enter("size", path)
        with self._lock:
            self._check_power(path)
        return super().size(path)

    def scandir(self, path: str) -> list[tuple[str, bool]]:
        self._enter("scandir", path)
        with self._lock:
            self._check_power(path)
        return super().scandir(path)

    # -- internals ---------------------------------------------------------------------------

    def _enter(self, op: str, path: str | None) -> None:
        """Count the call, then delay, pause or fail it as the test asked."""
        with self._lock:
            self.calls[op] += 1
            delays = [d.seconds for d in self._delays if d.op == op and _matches(d, path)]
            pause = None
            for handle in self._pauses:
                if handle.op != op or handle.is_used or not _matches(handle, path):
                    continue
                handle.num_seen += 1
                if handle.num_seen == handle.on_call:
                    handle.is_used = True
                    handle.path = path
                    pause = handle
                    break
            fault = None
            for candidate in self._faults:
                if candidate.op == op and _matches(candidate, path) and candidate.fires():
                    fault = candidate
                    break
        for seconds in delays:
            time.sleep(seconds)
        if pause is not None:
            pause.reached.set()
            if not pause.proceed.wait(self._pause_timeout_s):
                raise AssertionError(f"paused {op} was never released")
        if fault is not None:
            raise OSError(fault.errno, os.strerror(fault.errno), path)

    def _check_power(self, path: str | None) -> None:
        if self.is_powered_off:
            raise OSError(errno_mod.EIO, "simulated power loss", path)

    def _note_entry(self, path: str) -> None:
        directory, name = os.path.split(os.path.normpath(path))
        self._unsynced_entries.setdefault(directory, set()).add(name)

    def _forget_entry(self, path: str) -> None:
        directory, name = os.path.split(os.path.normpath(path))
        names = self._unsynced_entries.get(directory)
        if names is not None:
            names.discard(name)


def _matches(item: _Fault | Pause | _Delay, path: str | None) -> bool:
    return item.path_contains is None or (path is not None and item.path_contains in path)


def _check_op(op: str) -> None:
    if op not in OPS:
        raise ValueError(f"unknown file op {op!r}; ops are {list(OPS)}")
