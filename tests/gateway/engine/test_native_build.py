"""Building the C kernels on the machine: once, atomically, with a message a person can act on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gateway.engine.attention.paged import SOURCE as PAGED_SOURCE
from gateway.engine.native import build
from gateway.engine.native.build import NativeBuildError

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="no C compiler on this machine")


@needs_cc
def test_a_kernel_is_built_once_and_then_loaded_from_the_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_NATIVE_DIR", str(tmp_path))
    build.load(PAGED_SOURCE)
    built = list(tmp_path.glob("paged_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    build.load(PAGED_SOURCE)
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("paged_attention-*.so")] == [stamp]


@needs_cc
def test_the_portable_build_is_a_library_of_its_own(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_NATIVE_DIR", str(tmp_path))
    build.load(PAGED_SOURCE)
    build.load(PAGED_SOURCE, portable=True)
    expected = 2 if build.isa_flags(build.cpu_flags()) else 1
    assert len(list(tmp_path.glob("paged_attention-*.so"))) == expected


def test_without_a_compiler_the_error_says_what_to_install(monkeypatch) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(NativeBuildError, match="no C compiler found.*gcc"):
        build.compiler()


@needs_cc
def test_a_source_that_does_not_compile_names_the_compilers_complaint(tmp_path,
                                                                       monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_NATIVE_DIR", str(tmp_path / "out"))
    broken = tmp_path / "broken.c"
    broken.write_text("int f(void) { return undeclared_name; }\n")
    with pytest.raises(NativeBuildError, match="undeclared_name"):
        build.load(broken)
    assert not [p for p in (tmp_path / "out").iterdir() if p.suffix == ".so"]


@needs_cc
def test_an_unwritable_cache_directory_names_the_setting_to_change(tmp_path,
                                                                   monkeypatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVGATE_NATIVE_DIR", str(Path(blocker) / "native"))
    with pytest.raises(NativeBuildError, match="KVGATE_NATIVE_DIR"):
        build.load(PAGED_SOURCE)
