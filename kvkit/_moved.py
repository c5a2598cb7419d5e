"""Old module paths of kvkit, importable for one more release.

kvkit 0.1 moved modules into rooms by role (``kvkit.sim``,
``kvkit.worker``, ``kvkit.manager``). Their old paths appeared in the README
and the notebooks, so they stay importable until the next release: importing
one warns once with a :class:`DeprecationWarning` naming the new path, and the
old name is the new module object itself (same classes, same state), so
``isinstance`` and monkeypatching see one module.

Invariants:
    * Only the names in :data:`MOVED` are answered; every other import is left
      to the normal finders.
    * The moved module keeps its own ``__spec__`` (the alias never renames it).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

from typing_extensions import override

__all__ = ["MOVED", "install"]

MOVED: dict[str, str] = {
    "kvkit.bench_transfer": "kvkit.sim.transfer_bench",
    "kvkit.engine_loop": "kvkit.sim.engine_loop",
    "kvkit.layouts": "kvkit.worker.layouts",
    "kvkit.policy_study": "kvkit.sim.policy_study",
    "kvkit.request": "kvkit.manager.requests",
    "kvkit.simulator": "kvkit.sim.simulator",
    "kvkit.step": "kvkit.manager.step",
    "kvkit.synthetic": "kvkit.sim.synthetic",
    "kvkit.traces": "kvkit.sim.traces",
    "kvkit.transfer_engine": "kvkit.worker.engine",
}
"""Old module path -> the module that replaced it."""


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module that replaced it."""

    def __init__(self, new: str) -> None:
        self._new = new
        self._spec: importlib.machinery.ModuleSpec | None = None

    @override
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # stacklevel 2 lands on the importing line: the warnings module skips importlib's frames.
        warnings.warn(f"{spec.name} is deprecated and goes away in the next release; import {self._new} "
                      f"(or the same name from kvkit) instead", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self._new)
        self._spec = module.__spec__
        return module

    @override
    def exec_module(self, module: ModuleType) -> None:
        # The import system set the alias spec on the shared module object; give it its own back.
        module.__spec__ = self._spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Answers the old paths in :data:`MOVED`, nothing else."""

    @override
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        return None if new is None else importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once per process."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
