"""``make test`` cannot skip the Redis tests: with KVGATE_REQUIRE_REDIS=1 (the Makefile sets it)
a missing ``redis-server`` or ``redis-cli`` stops the run, naming the binary and its package."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import redis_harness

ROOT = Path(__file__).resolve().parents[1]


def test_a_missing_redis_cli_is_named_with_its_debian_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(redis_harness, "REDIS_CLI", "/nonexistent/redis-cli")
    assert redis_harness.redis_server_missing() == (
        "redis-cli not found on PATH: install Debian's redis-tools "
        "(`sudo apt-get install -y redis-tools`, or `make redis-server`)")


def test_with_kvgate_require_redis_a_missing_binary_fails_the_run() -> None:
    script = (
        "import sys, pytest, tests.redis_harness as h\n"
        "h.REDIS_SERVER = '/nonexistent/redis-server'\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--collect-only',\n"
        "                      'tests/policies/test_registry.py']))\n"
    )
    env = {**os.environ, "KVGATE_REQUIRE_REDIS": "1"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert ("KVGATE_REQUIRE_REDIS is set and the Redis tests cannot run: redis-server not found "
            "on PATH: install Debian's redis-server") in done.stderr


def test_make_test_requires_redis_and_installs_redis_cli_with_the_server() -> None:
    makefile = (ROOT / "Makefile").read_text()
    test_recipe = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert test_recipe is not None
    assert "KVGATE_REQUIRE_REDIS=1 $(VENV)/bin/pytest" in test_recipe.group(1)
    assert "apt-get install -y -qq \\\n\t    redis-server redis-tools" in makefile
