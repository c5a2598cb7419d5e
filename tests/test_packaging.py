"""Packaging: the wheel carries every subpackage; import hygiene of ``kvkit``."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> its import path inside the wheel (setuptools package-dir)
SOURCE_DIRS = {"kvkit": "kvkit", "interfaces": "kvkit/interfaces", "backends": "kvkit/backends"}


def source_packages() -> set[str]:
    """Wheel paths of every folder with an ``__init__.py`` under the mapped source folders."""
    found = set()
    for folder, target in SOURCE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                relative = init.parent.relative_to(ROOT / folder).as_posix()
                found.add(target if relative == "." else f"{target}/{relative}")
    return found


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """File names inside a wheel built from a copy of the source tree (the checkout stays clean)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "notebooks", "out", "*.so"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
         "-q", "-w", str(tmp / "dist")],
        check=True, capture_output=True, text=True, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("kvkit-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_wheel_contains_every_subpackage(wheel_names):
    """Every source folder with an __init__.py ships in the wheel at its kvkit.* path, plus py.typed."""
    missing = sorted(p for p in source_packages() if f"{p}/__init__.py" not in wheel_names)
    assert not missing, f"add these to [tool.setuptools] packages in pyproject.toml: {missing}"
    assert {"kvkit/py.typed", "kvkit/interfaces/__init__.py", "kvkit/backends/__init__.py"} <= wheel_names


@pytest.mark.compiler
@pytest.mark.parametrize("module", ["backends/eviction/hit_density/_booking", "backends/eviction/hit_density/_kernels",
                                    "backends/eviction/hit_density/_census", "backends/eviction/hit_density/_selection",
                                    "backends/eviction/_chains_loops", "backends/eviction/_queue_loops",
                                    "backends/allocator/_pool_loops", "manager/_progress"])
def test_wheel_carries_the_compiled_loops(wheel_names, module):
    """Where a C compiler is, the build compiles hit density's booking loops, census, density kernels and
    selection rounds, the chain index's and the parking queue's loops, the block pool's per-block loops and
    the manager's progress items of a decode step into the wheel."""
    assert any(name.startswith(f"kvkit/{module}.") and name.endswith(".so") for name in wheel_names)


def test_wheel_ships_the_builtin_traces(wheel_names):
    """Every built-in trace and its licence note are package data of the wheel, not only files of the checkout."""
    from kvkit.sim.traces import BUILTIN_TRACES

    assert {f"kvkit/sim/data/{name}" for name in BUILTIN_TRACES.values()} <= wheel_names
    assert "kvkit/sim/data/NOTICE.md" in wheel_names


def test_wheel_declares_console_script(wheel_names):
    """The wheel's entry points declare the `kvkit` console script."""
    assert any(n.endswith(".dist-info/entry_points.txt") for n in wheel_names)


@pytest.mark.parametrize("name", ["interfaces", "backends"])
def test_bare_source_folders_are_not_importable(name, tmp_path):
    """The source folders are only reachable as kvkit.* (no second copy of the modules).

    Asked from a fresh interpreter outside the checkout, so that neither the
    current directory nor the test runner's path makes the folder importable.
    """
    code = f"import importlib.util; print(importlib.util.find_spec({name!r}) is None)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env=env)
    assert out.stdout.strip() == "True"


def test_import_kvkit_touches_neither_cupy_nor_cuda():
    """A fresh `import kvkit` imports no CuPy and does not initialise CUDA."""
    code = (
        "import json, sys, kvkit\n"
        "torch = sys.modules.get('torch')\n"
        "print(json.dumps({'cupy': sorted(m for m in sys.modules if m.split('.')[0] == 'cupy'),\n"
        "                  'cuda': bool(torch is not None and torch.cuda.is_initialized())}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == {"cupy": [], "cuda": False}


def _fresh_modules(code: str) -> dict:
    """The JSON that ``code`` prints, run in a fresh interpreter at the repository root."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def test_import_kvkit_loads_neither_torch_nor_the_manager_nor_the_registry():
    """The facade resolves names on first use: a bare `import kvkit` loads none of the heavy parts."""
    heavy = ["torch", "kvkit.manager", "kvkit.registry", "kvkit.config", "kvkit.stack"]
    loaded = _fresh_modules(f"import json, sys, kvkit\nprint(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    assert loaded == []


def backend_modules() -> list[str]:
    """Import paths of every module under ``backends/`` (``kvkit.backends.*``)."""
    names = []
    for path in sorted((ROOT / "backends").rglob("*.py")):
        parts = ["kvkit", "backends", *path.relative_to(ROOT / "backends").with_suffix("").parts]
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_interfaces_and_backends_never_import_the_composition_layer():
    """Importing the interfaces and every backend module, one by one, loads no manager, registry, config or stack."""
    modules = ["kvkit.interfaces.types", "kvkit.interfaces", *backend_modules()]
    code = (
        "import importlib, json, sys\n"
        "above = ('kvkit.manager', 'kvkit.registry', 'kvkit.config', 'kvkit.stack')\n"
        "leaks = {}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    found = sorted(m for m in sys.modules if m.startswith(above))\n"
        "    if found:\n"
        "        leaks[name] = found\n"
        "        break\n"
        "print(json.dumps(leaks))\n"
    )
    assert _fresh_modules(code) == {}, "arrows point one way: interfaces <- backends <- kvkit (docs/architecture.md)"
