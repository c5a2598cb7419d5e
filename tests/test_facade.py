"""The public facade: lazy names, ``kvkit.register``, deprecated module paths, and docs that use only the facade."""

import ast
import importlib
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import kvkit
from kvkit import _moved
from kvkit.errors import ConfigError
from kvkit.interfaces import EvictionPolicy
from kvkit.registry import REGISTRIES, Registry
from kvkit.testing.doubles import InertPolicy

ROOT = Path(__file__).resolve().parents[1]
# Besides the facade, the only public import paths (DESIGN.md §2; README "Compose a stack").
PUBLIC_SUBPACKAGES = ("testing", "integrations")


def test_all_is_sorted_and_names_exactly_the_lazy_table():
    """``__all__`` is sorted and holds ``errors`` plus every key of the lazy table, nothing else."""
    assert kvkit.__all__ == sorted(kvkit.__all__)
    assert set(kvkit.__all__) == set(kvkit._LAZY) | {"errors"}


@pytest.mark.parametrize("name", kvkit.__all__)
def test_every_public_name_resolves_and_is_cached(name):
    """Each name resolves to its target's object and is then a plain module global."""
    value = getattr(kvkit, name)
    if name in kvkit._LAZY:
        module, _, attr = kvkit._LAZY[name].partition(":")
        assert value is getattr(importlib.import_module(module), attr)
    assert vars(kvkit)[name] is value


def test_type_checking_imports_name_the_lazy_targets():
    """The ``TYPE_CHECKING`` block imports exactly what ``_LAZY`` resolves, from the same modules."""
    tree = ast.parse((ROOT / "kvkit" / "__init__.py").read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"]
    imported = {alias.asname or alias.name: f"{node.module}:{alias.name}"
                for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert imported == kvkit._LAZY


def test_facade_exports_every_protocol_and_value_type():
    """Every name of ``kvkit.interfaces.__all__`` is a facade name bound to the same object."""
    import kvkit.interfaces as interfaces

    missing = sorted(set(interfaces.__all__) - set(kvkit.__all__))
    assert not missing, f"add to kvkit._LAZY: {missing}"
    for name in interfaces.__all__:
        assert getattr(kvkit, name) is getattr(interfaces, name)


def test_dir_lists_unresolved_names_and_unknown_names_raise():
    """``dir(kvkit)`` shows every public name; an unknown name is an AttributeError naming it."""
    assert set(kvkit.__all__) <= set(dir(kvkit))
    with pytest.raises(AttributeError, match="'no_such_name'"):
        kvkit.no_such_name


# -- kvkit.register ---------------------------------------------------------------


class _Policy(InertPolicy):
    pass


@pytest.fixture
def fresh_eviction(monkeypatch):
    """An empty eviction registry in place of the real one for the test's duration."""
    registry = Registry("eviction", EvictionPolicy, "eviction policy")
    monkeypatch.setitem(REGISTRIES, "eviction", registry)
    return registry


def test_register_adds_a_name_to_the_registry_of_its_kind(fresh_eviction):
    """``kvkit.register(kind, name, target)`` makes ``name`` creatable from that kind's registry."""
    kvkit.register("eviction", "mine", _Policy)
    assert "mine" in fresh_eviction.names()
    assert isinstance(fresh_eviction.create("mine"), _Policy)


def test_register_refuses_a_taken_name_unless_override(fresh_eviction):
    """A second registration of one name is a ConfigError; ``override=True`` replaces it."""
    kvkit.register("eviction", "mine", _Policy)
    with pytest.raises(ConfigError, match="'mine' is already registered.*override=True"):
        kvkit.register("eviction", "mine", "tests.nowhere:Policy")
    kvkit.register("eviction", "mine", "tests.nowhere:Policy", override=True)
    assert fresh_eviction.target("mine") == "tests.nowhere:Policy"


@pytest.mark.parametrize(("kind", "message"), [
    ("evicton", r"unknown registry kind 'evicton'; valid: eviction, store, copy, allocator, shared; "
                r"did you mean 'eviction'\?"),
    (["eviction"], r"unknown registry kind \['eviction'\]; valid: eviction, store, copy, allocator, shared$"),
])
def test_register_quotes_an_unknown_kind_and_lists_the_kinds(kind, message):
    """An unknown kind is a ConfigError that quotes it, lists the kinds and suggests the closest."""
    with pytest.raises(ConfigError, match=message):
        kvkit.register(kind, "mine", _Policy)


# -- deprecated module paths ------------------------------------------------------


@pytest.mark.parametrize(("old", "new"), sorted(_moved.MOVED.items()))
def test_old_module_path_is_the_new_module_and_warns_once(old, new):
    """Importing an old path warns once, naming the new path, and yields the new module itself."""
    assert not (ROOT / "kvkit" / f"{old.rpartition('.')[2]}.py").exists(), "a real module shadows the alias"
    sys.modules.pop(old, None)
    try:
        with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated") + ".*" + re.escape(new)):
            module = importlib.import_module(old)
        target = importlib.import_module(new)
        assert module is target and module.__spec__.name == new and module.__name__ == new
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert importlib.import_module(old) is target  # cached: no second warning
    finally:
        sys.modules.pop(old, None)
        vars(kvkit).pop(old.rpartition(".")[2], None)


def test_old_path_warning_points_at_the_importing_line():
    """A script's ``from kvkit.simulator import simulate`` shows the warning (Python's default filters)."""
    out = subprocess.run([sys.executable, "-c", "from kvkit.simulator import simulate\nassert simulate"],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    assert "<string>:1: DeprecationWarning: kvkit.simulator is deprecated" in out.stderr
    assert "import kvkit.sim.simulator" in out.stderr


# -- docs, notebooks, examples and benchmarks use only the public paths ----------


def _doc_sources() -> list:
    """A param ``(whole text, python code blocks)`` per README, notebook, example and benchmark."""
    readme = (ROOT / "README.md").read_text()
    sources = [pytest.param(readme, re.findall(r"```python\n(.*?)```", readme, re.S), id="README.md")]
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        text = "\n".join("".join(c["source"]) for c in cells)
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        sources.append(pytest.param(text, code, id=path.name))
    for path in sorted([*(ROOT / "examples").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        text = path.read_text()
        sources.append(pytest.param(text, [text], id=path.relative_to(ROOT).as_posix()))
    return sources


def _is_public_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] != "kvkit" or len(parts) == 1 or parts[1] in PUBLIC_SUBPACKAGES


@pytest.mark.parametrize(("text", "code"), _doc_sources())
def test_docs_import_only_the_facade_testing_and_integrations(text, code):
    """No import of a deeper kvkit module, and no ``kvkit.<module>.`` reference except the public ones."""
    bad = []
    for block in code:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                bad += [f"from {node.module} import ..."] if not _is_public_module(node.module) else []
            elif isinstance(node, ast.Import):
                bad += [f"import {a.name}" for a in node.names if not _is_public_module(a.name)]
    public = {*kvkit.__all__, *PUBLIC_SUBPACKAGES}
    bad += [f"kvkit.{m}." for m in re.findall(r"\bkvkit\.(\w+)\.", text) if m not in public]
    assert not bad, f"reaches past the facade: {sorted(set(bad))}"
