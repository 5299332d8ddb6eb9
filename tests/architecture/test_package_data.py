"""What a wheel of kvgate carries: every C kernel source and header the engine compiles on the
machine at first use (a file left out of the package data is missing only where kvgate is
installed rather than checked out -- never in this repository's own tests but this one)."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_source_and_header_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = config["tool"]["setuptools"]["package-data"]["gateway"]
    package = ROOT / "gateway"
    files = sorted(path.relative_to(package).as_posix()
                   for pattern in ("*.c", "*.h") for path in package.rglob(pattern))
    assert files, "no kernel sources found"
    missing = [name for name in files if not any(fnmatch(name, glob) for glob in globs)]
    assert not missing, f"not in [tool.setuptools.package-data] gateway: {missing}"
