"""Compiling kvgate's C kernels once per machine, and loading them.

Why compile on the machine instead of shipping a binary: the kernels are small (one C file
each, no torch headers: a second to build), and built here they can use the instruction set
this CPU has. Their numbers do not depend on it: the sources spell out every floating-point
operation and are compiled with ``-ffp-contract=off`` and no fast-math, so only their speed
does (see ``paged_attention.c``).

Each source sits beside the module that calls it (``gateway/engine/attention/native/``,
``gateway/engine/linear/native/``) and is named by its path; the vector helpers they share
are one header (``include/kvgate_lanes.h``). The library is built into ``KVGATE_NATIVE_DIR``
(default ``~/.cache/kvgate/native``) under a name that digests the source, the shared headers,
the flags and the compiler, so a changed source or header is rebuilt and a built one is
loaded in milliseconds. It is written to a temporary name and renamed: a start interrupted
mid-build leaves no half-written library behind. Where no C compiler is found the build fails
with a message naming it, and the caller serves with the kernels torch has.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-std=gnu11", "-shared", "-fPIC", "-fno-fast-math", "-ffp-contract=off",
              "-fopenmp", "-Wall", "-Wno-psabi")
"""Every build's flags. NOTE: ``-fopenmp`` links ``libgomp.so.1``, the soname torch's own
OpenMP runtime has, so the loader reuses torch's: one thread pool, sized by
``torch.set_num_threads``."""


INCLUDE_DIR = Path(__file__).resolve().parent / "include"
"""The headers every kernel may include (``kvgate_lanes.h``: the vector helpers they share);
on every build's include path, and their text part of every library's digest."""

INCLUDE_FLAGS = ("-I", str(INCLUDE_DIR))
"""The compiler flags that put ``INCLUDE_DIR`` on the include path (kept out of the digest:
where the checkout lies does not change what is built, the headers' text does)."""


class NativeBuildError(RuntimeError):
    """A kernel could not be compiled or loaded here: the message says why and what to do."""


def cpu_flags() -> frozenset[str]:
    """This CPU's instruction-set flags (empty where ``/proc/cpuinfo`` is not readable)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def isa_flags(flags: frozenset[str], *, wide_vectors: bool = False) -> tuple[str, ...]:
    """Compiler flags for the vector units ``flags`` names (none: portable code, same bits);
    ``wide_vectors``: AVX-512's too, where ``flags`` has it."""
    if not {"avx2", "fma"} <= flags:
        return ()
    wide = ("-mavx512f",) if wide_vectors and "avx512f" in flags else ()
    return ("-mavx2", "-mfma", *wide)


def compiler() -> str:
    """The C compiler to build with: ``$CC``, else ``cc``/``gcc`` on PATH.

    Raises:
        NativeBuildError: none is found.
    """
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    raise NativeBuildError("no C compiler found (set CC, or install gcc: the Debian package "
                           "gcc) to build kvgate's C kernels")


def cache_dir() -> Path:
    configured = os.environ.get("KVGATE_NATIVE_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgate" / "native"


def load(source: Path, *, portable: bool = False, wide_vectors: bool = False) -> ctypes.CDLL:
    """The library built from the C file ``source``, built if needed.

    ``portable``: build without this CPU's vector-unit flags (what a CPU without AVX2 runs;
    the tests compare its bits with the vectorised build's). ``wide_vectors``: AVX-512 too
    where this CPU has it (a kernel whose source has a 16-lane path).

    Raises:
        NativeBuildError: the compiler is missing or failed, or the library does not load.
    """
    cc = compiler()
    flags = BASE_FLAGS if portable else (*BASE_FLAGS,
                                         *isa_flags(cpu_flags(), wide_vectors=wide_vectors))
    version = _compiler_version(cc)
    headers = [path.read_text(encoding="utf-8") for path in sorted(INCLUDE_DIR.glob("*.h"))]
    digest = hashlib.sha256("\0".join([source.read_text(encoding="utf-8"), *headers, *flags,
                                       version]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if not target.exists():
        _build(cc, flags, source, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as exc:
        raise NativeBuildError(f"{target} does not load: {exc}") from exc


def _compiler_version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeBuildError(f"{cc} --version failed: {exc}") from exc
    return done.stdout.splitlines()[0] if done.stdout else cc


def _build(cc: str, flags: tuple[str, ...], source: Path, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeBuildError(f"cannot create {target.parent} for kvgate's compiled kernels "
                               f"({exc}); set KVGATE_NATIVE_DIR to a writable directory") from exc
    logger.info("compiling %s with %s (once per machine and source) into %s", source.name, cc,
                target)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, *INCLUDE_FLAGS, str(source), "-o", partial, "-lm"],
                              capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise NativeBuildError(f"{cc} could not build {source.name} (exit "
                                   f"{done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeBuildError(f"building {source.name} with {cc} failed: {exc}") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
