"""The host tier's name is spelled once, in its kind's module (``tiers.kinds.host.HOST``); every
other place names it through that constant. The server's bind ``host`` is another word, spelled
where ``[server]`` and the command line read it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIND_HOST = {"gateway/cli/main.py", "gateway/config/loader.py", "gateway/config/server.py"}
"""Modules that read the server's bind ``host`` (a key of ``[server]`` or a flag)."""


def test_the_host_tier_is_named_in_its_kind_module_only() -> None:
    found = []
    for package in ("gateway", "tiers", "policies"):
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where in BIND_HOST or where == "tiers/kinds/host.py" or "/pb/" in where:
                continue
            tree = ast.parse(path.read_text(), filename=where)
            found += [f"{where}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and node.value == "host"]
    assert not found, f"the host tier spelled as a literal outside tiers/kinds/host.py: {found}"
