"""The rooms' import arrows point one way (docs/architecture.md)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BASE = ("kvkit.errors", "kvkit.validate")

# room -> the kvkit modules it may import (prefixes); everything else of kvkit is forbidden.
ALLOWED = {
    "kvkit.interfaces": (*_BASE, "kvkit.interfaces"),
    "kvkit.backends": (*_BASE, "kvkit.interfaces", "kvkit.backends"),
    "kvkit.manager": (*_BASE, "kvkit.interfaces", "kvkit.stats", "kvkit.manager"),
    "kvkit.worker": (*_BASE, "kvkit.interfaces", "kvkit.worker"),
}

# The manager's parts, in data-flow order: each imports only parts before it (nothing climbs back).
MANAGER_ORDER = ["requests", "ended", "events", "step", "transfers", "hits", "stores", "shared", "manager"]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in ("interfaces", "backends"):
        parts.insert(0, "kvkit")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = [*ROOT.glob("kvkit/**/*.py"), *ROOT.glob("interfaces/**/*.py"), *ROOT.glob("backends/**/*.py")]
    return {_module_name(p): p for p in files}


def _kvkit_imports(path: Path) -> set[str]:
    """Every kvkit module ``path`` imports, at any depth of its code (deferred imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvkit"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvkit"):
            if node.module == "kvkit":
                found.update(f"kvkit.{a.name}" for a in node.names)
            else:
                found.add(node.module)
    return found


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


SOURCES = _sources()


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_rooms_import_only_what_lies_below_them(room):
    """Interfaces, backends, manager and worker import only the rooms their arrows allow."""
    bad = {mod: sorted(i for i in _kvkit_imports(path) if not _within(i, ALLOWED[room]))
           for mod, path in SOURCES.items() if _within(mod, (room,))}
    assert {m: b for m, b in bad.items() if b} == {}


def test_manager_parts_never_climb_back():
    """Each manager part imports only the parts before it in data-flow order."""
    seen = {f"kvkit.manager.{p}" for p in MANAGER_ORDER}
    assert seen <= set(SOURCES), seen - set(SOURCES)
    assert {m for m in SOURCES if m.startswith("kvkit.manager.")} == seen, "a new part needs a place in the order"
    for i, part in enumerate(MANAGER_ORDER):
        later = {f"kvkit.manager.{p}" for p in MANAGER_ORDER[i:]} | {"kvkit.manager"}
        imported = _kvkit_imports(SOURCES[f"kvkit.manager.{part}"])
        assert not imported & later, f"kvkit.manager.{part} imports {sorted(imported & later)}"


def test_the_check_fails_on_a_climbing_import(tmp_path):
    """The import scan sees deferred imports, so a planted upward import would be caught."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from kvkit.manager import OffloadManager\n    import kvkit.sim.simulator\n")
    assert _kvkit_imports(planted) == {"kvkit.manager", "kvkit.sim.simulator"}
    assert not _within("kvkit.manager", ALLOWED["kvkit.worker"])
