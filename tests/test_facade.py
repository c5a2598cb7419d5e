"""The public facade: lazy names, ``kvkit.register``, deprecated module paths, and docs that use only the facade."""

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

import kvkit
from kvkit.errors import ConfigError
from kvkit.interfaces import EvictionPolicy
from kvkit.registry import REGISTRIES, Registry
from kvkit.testing.doubles import InertPolicy

ROOT = Path(__file__).resolve().parents[1]
# Besides the facade, the public import paths (docs/architecture.md).
PUBLIC_SUBPACKAGES = ("interfaces", "backends", "errors", "config", "hashing", "sim", "reference", "shared", "bench",
                      "testing", "integrations")
"""The rooms whose own ``__all__`` is public: a user reaches every name past the facade through one of them."""


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


def test_facade_is_at_most_fifty_names_and_each_room_exports_the_rest():
    """The facade stays small; every protocol and value type is reachable from ``kvkit.interfaces``."""
    import kvkit.interfaces as interfaces

    assert len(kvkit.__all__) <= 50
    for name in set(interfaces.__all__) & set(kvkit.__all__):
        assert getattr(kvkit, name) is getattr(interfaces, name)
    for room in ("sim", "reference", "shared", "testing"):
        module = getattr(kvkit, room)
        for name in module.__all__:
            assert getattr(module, name) is not None, f"kvkit.{room}.{name}"


def test_errors_are_reachable_from_the_facade():
    """The errors a caller catches most are facade names; every error is in ``kvkit.errors``."""
    assert kvkit.ConfigError is kvkit.errors.ConfigError
    assert issubclass(kvkit.ConfigError, kvkit.KVKitError)


def test_dir_lists_unresolved_names_and_unknown_names_raise():
    """``dir(kvkit)`` shows every public name; an unknown name is an AttributeError naming it."""
    assert set(kvkit.__all__) <= set(dir(kvkit))
    with pytest.raises(AttributeError, match="'no_such_name'"):
        kvkit.no_such_name  # noqa: B018 - the access is the test


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
    with pytest.raises(ConfigError, match=r"'mine' is already registered.*override=True"):
        kvkit.register("eviction", "mine", "tests.nowhere:Policy")
    kvkit.register("eviction", "mine", "tests.nowhere:Policy", override=True)
    assert fresh_eviction.target("mine") == "tests.nowhere:Policy"


@pytest.mark.parametrize(("kind", "message"), [
    ("evicton", (r"unknown registry kind 'evicton'; valid: eviction, store, copy, allocator, shared, planner; "
                 r"did you mean 'eviction'\?")),
    (["eviction"], r"unknown registry kind \['eviction'\]; valid: eviction, store, copy, allocator, shared, planner$"),
])
def test_register_quotes_an_unknown_kind_and_lists_the_kinds(kind, message):
    """An unknown kind is a ConfigError that quotes it, lists the kinds and suggests the closest."""
    with pytest.raises(ConfigError, match=message):
        kvkit.register(kind, "mine", _Policy)


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
def test_docs_import_only_public_rooms(text, code):
    """No import of a deeper kvkit module, and no ``kvkit.<module>.`` reference except the public rooms."""
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
