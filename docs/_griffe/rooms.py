"""Griffe extension for kvkit's API pages (used by ``mkdocs.yml``; not part of the package).

Two things static analysis needs help with:

* ``pyproject.toml`` maps the folders ``interfaces/`` and ``backends/`` into the
  package as ``kvkit.interfaces`` and ``kvkit.backends``. Griffe finds submodules
  only inside ``kvkit/``, so when it visits the ``kvkit`` package this extension
  visits those two folders and attaches them under it (public Griffe API only).
* Docstrings use Sphinx roles (``:class:`~kvkit.x.Y```); Markdown has none, so
  each role becomes a code span (the last component with ``~``, else the whole
  target).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

_MAPPED = ("interfaces", "backends")
"""Folders beside ``kvkit/`` that install as ``kvkit.<folder>``."""

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")


def _code_span(match: re.Match[str]) -> str:
    target = match[2]
    return f"`{target.rsplit('.', 1)[-1] if match[1] else target}`"


def _visit(name: str, path: Path, parent: griffe.Module, agent: Any) -> None:
    """Visit ``path`` (a package folder or a module file) as ``parent.<name>`` and attach it."""
    filepath = path / "__init__.py" if path.is_dir() else path
    code = filepath.read_text(encoding="utf-8-sig")
    agent.lines_collection[filepath] = code.splitlines(keepends=False)
    module = griffe.visit(name, filepath, code, extensions=agent.extensions, parent=parent,
                          docstring_parser=agent.docstring_parser, docstring_options=agent.docstring_options,
                          lines_collection=agent.lines_collection, modules_collection=agent.modules_collection)
    parent.set_member(name, module)
    if path.is_dir():
        for child in sorted(path.iterdir()):
            if child.is_dir() and (child / "__init__.py").is_file():
                _visit(child.name, child, module, agent)
            elif child.suffix == ".py" and child.name != "__init__.py":
                _visit(child.stem, child, module, agent)


class KvkitRooms(griffe.Extension):
    """Attach ``interfaces/`` and ``backends/`` under ``kvkit``; turn Sphinx roles into code spans."""

    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        if obj.docstring is not None and ":`" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(_code_span, obj.docstring.value)

    def on_module_members(self, *, node: Any, mod: griffe.Module, agent: Any, **kwargs: Any) -> None:
        if mod.path != "kvkit" or not isinstance(agent, griffe.Visitor) or not isinstance(mod.filepath, Path):
            return
        root = mod.filepath.resolve().parent.parent
        for name in _MAPPED:
            if (root / name / "__init__.py").is_file() and name not in mod.members:
                _visit(name, root / name, mod, agent)
