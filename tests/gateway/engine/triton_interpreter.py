"""Run tests of Triton kernels on the CPU, in Triton's interpreter, whatever this process did.

Why a child process: Triton chooses between compiling kernels and interpreting them (numpy, on
the CPU) once, when ``triton.language`` is first imported -- from ``TRITON_INTERPRET`` then.
In the suite it is imported long before these tests run (running any transformers model
imports ``torch._dynamo``, which imports triton), compiled, and cannot switch. So a test
decorated ``@interpreted`` runs here only where this process's Triton interprets; elsewhere
the first such test of a module runs all of the module's decorated tests in one child process
started with ``TRITON_INTERPRET=1``, and each test reports its own outcome there (passed,
failed with the child's report, or skipped with its reason). A test's CUDA case
(``device="cuda"``, marked ``gpu``) always runs here, compiled.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

CHILD_ENV = "KVGATE_TRITON_CHILD"
"""Set in the child process: a test that still cannot run there fails instead of recursing."""

CHILD_TIMEOUT_S = 600


def interprets_here() -> bool:
    """Whether a Triton kernel launched in this process is interpreted."""
    if "triton.language" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")
    from gateway.engine.attention.triton_kernel import language_interpreted

    return language_interpreted()


_relayed: dict[str, list[str]] = {}
_outcomes: dict[str, dict[str, tuple[str, str]]] = {}


def interpreted(test: Callable[..., None]) -> Callable[..., None]:
    """Run ``test`` in Triton's interpreter: here if this process interprets, else in the
    module's child process (see the module docstring)."""
    if interprets_here():
        return test
    path = sys.modules[test.__module__].__file__
    assert path is not None
    _relayed.setdefault(path, []).append(test.__name__)

    @functools.wraps(test)
    def relay(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("device") == "cuda":
            test(*args, **kwargs)
            return
        if os.environ.get(CHILD_ENV):
            pytest.fail("Triton does not interpret in the child process either")
        name = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].rsplit(" (", 1)[0]
        outcome, detail = _child_outcomes(path).get(name, ("failed", "the child did not run it"))
        if outcome == "skipped":
            pytest.skip(f"(in Triton's interpreter, a child process) {detail}")
        if outcome != "passed":
            pytest.fail(f"in Triton's interpreter (a child process): {detail}", pytrace=False)

    return relay


def _child_outcomes(path: str) -> dict[str, tuple[str, str]]:
    """Each relayed test of module ``path`` by name (parameters included): its outcome in one
    child pytest run with the interpreter on, and the child's report of it."""
    if path not in _outcomes:
        root = Path(__file__).resolve().parents[3]
        report = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvgate-triton-{os.getpid()}.xml"
        env = {**os.environ, "TRITON_INTERPRET": "1", CHILD_ENV: "1"}
        # --noconftest: the suite's conftests would run the engine (and import triton) first.
        command = [sys.executable, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                   "-m", "not gpu", f"--junitxml={report}",
                   *(f"{path}::{name}" for name in _relayed[path])]
        try:
            done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT_S, check=False)
            outcomes = _read_report(report) if report.exists() else {}
        finally:
            report.unlink(missing_ok=True)
        if not outcomes:
            pytest.fail(f"the interpreted child run reported nothing (exit {done.returncode}):\n"
                        f"{done.stdout[-4000:]}{done.stderr[-4000:]}", pytrace=False)
        _outcomes[path] = outcomes
    return _outcomes[path]


def _read_report(report: Path) -> dict[str, tuple[str, str]]:
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, detail = "failed", f"{child.get('message', '')}\n{child.text or ''}"
            elif child.tag == "skipped":
                outcome, detail = "skipped", child.get("message", "")
        outcomes[case.get("name", "")] = (outcome, detail)
    return outcomes
