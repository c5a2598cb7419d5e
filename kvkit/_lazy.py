"""Lazy imports: a package names its public objects, and a module names a heavy dependency, without importing them.

A package calls :func:`lazy_exports` with ``{name: "module:attribute"}`` and
binds the two functions it returns as its module-level ``__getattr__`` and
``__dir__``. A name is imported on first access and cached in the package's
globals, so the hook runs at most once per name. A subpackage or module of
the package is imported on first access too (``kvkit.sim.OPT`` after
``import kvkit``); any other name raises ``AttributeError`` naming the package.

A module that needs a heavy library only when used (the copy backends and
torch, so ``kvkit list`` probes them without importing it) binds
:func:`lazy_module` in its globals instead of importing it; the first
attribute read imports the library and rebinds the name to it, so later reads
cost what a plain import's would.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any

from typing_extensions import override

__all__ = ["lazy_exports", "lazy_module"]


def lazy_exports(package: str, targets: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, resolving each name of ``targets`` on first use."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the package's module __getattr__
        target = targets.get(name)
        if target is not None:
            module, _, attr = target.partition(":")
            value = getattr(importlib.import_module(module), attr)
        elif not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807 - the package's module __dir__
        return sorted({*vars(sys.modules[package]), *targets})

    return __getattr__, __dir__


class _LazyModule:
    """Module ``name`` bound as ``binding`` in ``namespace``, until its first attribute read imports it."""

    __slots__ = ("_binding", "_name", "_namespace")

    def __init__(self, name: str, namespace: dict[str, Any], binding: str) -> None:
        self._name, self._namespace, self._binding = name, namespace, binding

    def __getattr__(self, attribute: str) -> Any:
        module = importlib.import_module(self._name)
        if self._namespace.get(self._binding) is self:
            self._namespace[self._binding] = module
        return getattr(module, attribute)

    @override
    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_module(name: str, namespace: dict[str, Any]) -> Any:
    """A stand-in for module ``name`` to bind as its last component in ``namespace`` (a module's ``globals()``).

    Reading any attribute imports ``name`` and replaces the stand-in in
    ``namespace`` with the module. Bind it under ``if not TYPE_CHECKING:``
    beside a plain ``import`` for type checkers.
    """
    return _LazyModule(name, namespace, name.rpartition(".")[2])
