"""The tree shows the architecture: imports point down the layers of docs/design.md, "Layout".

    cli → bench → service → config → engine → cache → core      (gateway/)
    inside gateway/cache/: operations → the core (the modules directly in gateway/cache/)
    inside gateway/engine/: engine.py, settings.py → scheduling → parity → models → forward
        → attention → kv → linear → output → native
    gateway.client → core and the generated stubs only (it imports nothing of the server)
    tiers → policies and gateway.core only;  policies → gateway.core only

Read from the source with ``ast`` (nothing is imported), so a violation names file and line.
And no import cycle among the modules, counting the imports a module runs when it is imported
(those inside a function or under ``TYPE_CHECKING`` break no cycle at import time, and are not
counted).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("cli", "bench", "service", "vllm_connector", "config", "engine", "cache", "core")
ENGINE_LAYERS = ("scheduling", "parity", "models", "forward", "attention", "kv", "linear",
                 "output", "native")
"""gateway/engine/'s sub-packages, top to bottom (gateway/engine/__init__.py says what each
holds); the modules directly in gateway/engine/ (the ``Engine`` and its settings) sit above
them all."""
MAX_MODULE_LINES = 600
GENERATED = {"kvgate_pb2.py", "kvgate_pb2_grpc.py", "kvgate_pb2.pyi"}


def _modules() -> list[Path]:
    return sorted(p for pkg in ("gateway", "tiers", "policies") for p in (ROOT / pkg).rglob("*.py")
                  if p.name not in GENERATED)


def _imports(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _where(path: Path) -> tuple[str, str | None]:
    """(top package, gateway layer or None) of a source file."""
    rel = path.relative_to(ROOT).parts
    if rel[0] == "gateway" and len(rel) > 2:
        return "gateway", rel[1]
    return rel[0], None if rel[0] != "gateway" else rel[1].removesuffix(".py")


def _allowed(path: Path, target: str) -> bool:
    package, layer = _where(path)
    parts = target.split(".")
    if parts[0] not in ("gateway", "tiers", "policies"):
        return True
    if package == "policies":
        return parts[0] == "policies" or parts[:2] == ["gateway", "core"]
    if package == "tiers":
        return parts[0] in ("tiers", "policies") or parts[:2] == ["gateway", "core"]
    if parts[0] in ("tiers", "policies"):
        return True
    if len(parts) == 1:
        return False
    if layer == "client":
        return parts[1] == "core" or parts[:3] == ["gateway", "service", "pb"]
    if layer not in LAYERS:  # gateway/__init__.py
        return False
    if parts[1] == "client":
        return LAYERS.index(layer) <= LAYERS.index("bench")
    if parts[1] not in LAYERS:
        return False
    return LAYERS.index(parts[1]) >= LAYERS.index(layer)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path: Path) -> None:
    upward = [f"line {line}: {target}" for line, target in _imports(path)
              if not _allowed(path, target)]
    assert not upward, f"{path.relative_to(ROOT)} imports against the layers: {upward}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_opens_with_a_docstring(path: Path) -> None:
    tree = ast.parse(path.read_text())
    assert ast.get_docstring(tree), f"{path.relative_to(ROOT)} has no module docstring"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_hand_written_module_is_over_the_size_limit(path: Path) -> None:
    num_lines = len(path.read_text().splitlines())
    assert num_lines <= MAX_MODULE_LINES, (
        f"{path.relative_to(ROOT)} has {num_lines} lines (> {MAX_MODULE_LINES}): split it")


def _engine_layer(path: Path) -> str | None:
    """The engine sub-package of a source file; "" for a module directly in gateway/engine/;
    None outside gateway/engine/."""
    rel = path.relative_to(ROOT).parts
    if rel[:2] != ("gateway", "engine"):
        return None
    return rel[2] if len(rel) > 3 else ""


def _engine_allowed(path: Path, target: str) -> bool:
    layer = _engine_layer(path)
    parts = target.split(".")
    if layer is None or parts[:2] != ["gateway", "engine"]:
        return True
    if layer == "":  # the Engine and its settings: above every sub-package
        return True
    if len(parts) < 3 or parts[2] not in ENGINE_LAYERS:  # gateway.engine.engine, .settings
        return False
    return ENGINE_LAYERS.index(parts[2]) >= ENGINE_LAYERS.index(layer)


_ENGINE_MODULES = [p for p in _modules() if _engine_layer(p) is not None]


@pytest.mark.parametrize("path", _ENGINE_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_engine_imports_point_down_its_sub_packages(path: Path) -> None:
    upward = [f"line {line}: {target}" for line, target in _imports(path)
              if not _engine_allowed(path, target)]
    assert not upward, f"{path.relative_to(ROOT)} imports against the engine's layers: {upward}"


def test_the_engine_layers_are_its_sub_packages() -> None:
    engine = ROOT / "gateway" / "engine"
    packages = {p.name for p in engine.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(ENGINE_LAYERS)


CACHE_ROOMS = ("operations", "")
"""gateway/cache/'s rooms, top to bottom: ``operations/`` (running and operating the cache) over
the core, the modules directly in gateway/cache/ (gateway/cache/__init__.py says what each
holds)."""


def _cache_room(path: Path) -> str | None:
    """The cache room of a source file ("" for the core); None outside gateway/cache/."""
    rel = path.relative_to(ROOT).parts
    if rel[:2] != ("gateway", "cache"):
        return None
    return rel[2] if len(rel) > 3 else ""


def _cache_allowed(path: Path, target: str) -> bool:
    room = _cache_room(path)
    parts = target.split(".")
    if room is None or parts[:2] != ["gateway", "cache"]:
        return True
    target_room = parts[2] if len(parts) > 3 and parts[2] in CACHE_ROOMS else ""
    return CACHE_ROOMS.index(target_room) >= CACHE_ROOMS.index(room)


_CACHE_MODULES = [p for p in _modules() if _cache_room(p) is not None]


@pytest.mark.parametrize("path", _CACHE_MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_cache_core_never_imports_its_operations(path: Path) -> None:
    upward = [f"line {line}: {target}" for line, target in _imports(path)
              if not _cache_allowed(path, target)]
    assert not upward, f"{path.relative_to(ROOT)} imports against the cache's rooms: {upward}"


def test_the_cache_rooms_are_its_sub_packages() -> None:
    cache = ROOT / "gateway" / "cache"
    packages = {p.name for p in cache.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == {room for room in CACHE_ROOMS if room}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_time_imports(path: Path) -> set[str]:
    """The modules ``path`` imports when it is imported: its top-level imports, outside
    ``if TYPE_CHECKING:`` (``from a import b`` counts ``a.b`` too, when that is a module)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If) and not (
                    isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text(), filename=str(path)).body)
    return found


def test_no_import_cycles() -> None:
    modules = {_module_name(p): p for p in _modules()}
    graph = {name: sorted(t for t in _import_time_imports(path) if t in modules and t != name)
             for name, path in modules.items()}
    # Iterative depth-first search; a grey module met again closes a cycle.
    colour: dict[str, int] = {}
    cycles: list[list[str]] = []
    for start in graph:
        if colour.get(start):
            continue
        stack: list[tuple[str, int]] = [(start, 0)]
        path: list[str] = [start]
        colour[start] = 1
        while stack:
            name, i = stack[-1]
            if i < len(graph[name]):
                stack[-1] = (name, i + 1)
                nxt = graph[name][i]
                if colour.get(nxt) == 1:
                    cycles.append(path[path.index(nxt):] + [nxt])
                elif not colour.get(nxt):
                    colour[nxt] = 1
                    stack.append((nxt, 0))
                    path.append(nxt)
            else:
                colour[name] = 2
                stack.pop()
                path.pop()
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_layers_are_the_packages_of_gateway() -> None:
    packages = {p.name for p in (ROOT / "gateway").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS)
