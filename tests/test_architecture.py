"""Every room's import arrows point one way (docs/architecture.md).

Each module of kvkit belongs to exactly one room; a room may import only the
rooms its arrows allow. Runtime imports count at any depth of the code
(deferred imports included); imports under ``if TYPE_CHECKING:`` do not, since
they never run.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_BASE = ("kvkit.redact", "kvkit.errors", "kvkit.validate", "kvkit.kept", "kvkit.driving", "kvkit._lazy", "kvkit.warn")
_PROTOCOLS = (*_BASE, "kvkit.interfaces")
_CORE = ("kvkit.config", "kvkit.registry", "kvkit.hashing", "kvkit.stats", "kvkit.stack")
_BELOW_EXPLORE = (*_PROTOCOLS, *_CORE, "kvkit.backends", "kvkit.manager", "kvkit.worker", "kvkit.shared",
                  "kvkit.reference")

# room -> the kvkit modules it may import (prefixes); everything else of kvkit is forbidden.
ALLOWED: dict[str, tuple[str, ...]] = {
    "kvkit.redact": (),
    "kvkit.errors": ("kvkit.redact",),
    "kvkit.validate": ("kvkit.errors", "kvkit.redact"),
    "kvkit.kept": ("kvkit.errors", "kvkit.redact", "kvkit.warn"),
    "kvkit.driving": ("kvkit.errors", "kvkit.redact"),
    "kvkit._lazy": (),
    "kvkit.warn": (),
    "kvkit.interfaces": _PROTOCOLS,
    "kvkit.backends": (*_PROTOCOLS, "kvkit.backends"),
    "kvkit.stats": _BASE,
    "kvkit.hashing": _PROTOCOLS,
    "kvkit.registry": _PROTOCOLS,
    "kvkit.config": (*_PROTOCOLS, "kvkit.hashing", "kvkit.registry", "kvkit.worker"),
    "kvkit.worker": (*_PROTOCOLS, "kvkit.worker"),
    # the shared tier's scheduler part is one of the manager's parts (see MANAGER_ORDER)
    "kvkit.manager": (*_PROTOCOLS, "kvkit.stats", "kvkit.manager", "kvkit.shared.scheduler"),
    "kvkit.shared": (*_PROTOCOLS, "kvkit.stats", "kvkit.config", "kvkit.registry", "kvkit.backends.blockstore",
                     "kvkit.manager.backpressure", "kvkit.manager.events", "kvkit.manager.requests",
                     "kvkit.manager.transfers", "kvkit.worker", "kvkit.shared"),
    "kvkit.stack": (*_PROTOCOLS, "kvkit.config", "kvkit.registry", "kvkit.stats", "kvkit.manager", "kvkit.worker",
                    "kvkit.shared"),
    "kvkit.reference": (*_PROTOCOLS, *_CORE, "kvkit.manager", "kvkit.worker", "kvkit.reference"),
    "kvkit.integrations": (*_BELOW_EXPLORE, "kvkit.integrations"),
    "kvkit.sim": (*_BELOW_EXPLORE, "kvkit.sim"),
    "kvkit.bench": (*_BELOW_EXPLORE, "kvkit.bench", "kvkit.testing.servers"),
    "kvkit.cli": (*_BELOW_EXPLORE, "kvkit.sim", "kvkit.bench", "kvkit.cli", "kvkit.testing.servers"),
    "kvkit.testing": (*_PROTOCOLS, "kvkit.backends", "kvkit.worker", "kvkit.manager", "kvkit.testing"),
    "kvkit": ("kvkit",),  # the facade names every room, lazily
}

# The manager's parts, in data-flow order: each imports only parts before it (nothing climbs back).
MANAGER_ORDER = ["kvkit.manager.backpressure", "kvkit.manager.requests", "kvkit.manager.ended",
                 "kvkit.manager.events", "kvkit.manager.step", "kvkit.manager.transfers", "kvkit.manager.hits",
                 "kvkit.manager.stores", "kvkit.shared.scheduler", "kvkit.manager.manager"]


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


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` blocks."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _kvkit_imports(path: Path) -> set[str]:
    """Every kvkit module ``path`` imports at run time, at any depth of its code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = _type_checking_nodes(tree)
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
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


def _room(module: str) -> str:
    """The room ``module`` belongs to: the longest key of ALLOWED that contains it."""
    return max((r for r in ALLOWED if _within(module, (r,))), key=len)


SOURCES = _sources()


def test_every_module_has_a_room_of_its_own():
    """No module falls through to the facade's room except the facade and its lazy-export helper."""
    assert {m for m in SOURCES if _room(m) == "kvkit"} == {"kvkit"}


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_rooms_import_only_what_their_arrows_allow(room):
    """Each room imports only the rooms its arrows allow."""
    bad = {mod: sorted(i for i in _kvkit_imports(path) if not _within(i, ALLOWED[room]))
           for mod, path in SOURCES.items() if _room(mod) == room}
    assert {m: b for m, b in bad.items() if b} == {}


def test_integrations_never_import_the_explorers():
    """The engines' integrations never import the simulator, the benchmarks, the CLI or the test kit."""
    for mod, path in SOURCES.items():
        if _room(mod) == "kvkit.integrations":
            bad = [i for i in _kvkit_imports(path) if _within(i, ("kvkit.sim", "kvkit.bench", "kvkit.cli",
                                                                   "kvkit.testing"))]
            assert not bad, (mod, bad)


def test_testing_imports_no_private_backend_module():
    """The contract suites build on public modules only, so a user's backend meets what kvkit's meet."""
    for mod, path in SOURCES.items():
        if _room(mod) == "kvkit.testing":
            private = [i for i in _kvkit_imports(path)
                       if i.startswith("kvkit.backends") and any(p.startswith("_") for p in i.split("."))]
            assert not private, (mod, private)


@pytest.mark.parametrize("module", ["kvkit.testing", "kvkit.testing.eviction_contract",
                                    "kvkit.testing.allocator_contract", "kvkit.testing.store_contract",
                                    "kvkit.testing.blockstore_contract"])
def test_a_contract_without_tensors_loads_no_torch(module):
    """An eviction-policy or store author's contract suite imports neither torch nor CuPy."""
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_manager_parts_never_climb_back():
    """Each manager part imports only the parts before it in data-flow order."""
    manager = {m for m in SOURCES if m.startswith("kvkit.manager.")}
    assert manager <= set(MANAGER_ORDER), f"a new part needs a place in the order: {manager - set(MANAGER_ORDER)}"
    for i, part in enumerate(MANAGER_ORDER):
        later = set(MANAGER_ORDER[i:]) | {"kvkit.manager"}
        imported = _kvkit_imports(SOURCES[part])
        assert not imported & later, f"{part} imports {sorted(imported & later)}"


def test_the_check_fails_on_a_climbing_import(tmp_path):
    """The import scan sees deferred imports and skips type-only ones, so a planted upward import is caught."""
    planted = tmp_path / "planted.py"
    planted.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kvkit.cli\n"
                       "def f():\n    from kvkit.manager import OffloadManager\n    import kvkit.sim.simulator\n")
    assert _kvkit_imports(planted) == {"kvkit.manager", "kvkit.sim.simulator"}
    assert not _within("kvkit.manager", ALLOWED["kvkit.worker"])
    assert not _within("kvkit.sim.simulator", ALLOWED["kvkit.integrations"])
