"""Lazy exports (PEP 562): a package names its public objects without importing the modules behind them.

A package calls :func:`lazy_exports` with ``{name: "module:attribute"}`` and
binds the two functions it returns as its module-level ``__getattr__`` and
``__dir__``. A name is imported on first access and cached in the package's
globals, so the hook runs at most once per name. A subpackage or module of
the package is imported on first access too (``kvkit.sim.OPT`` after
``import kvkit``); any other name raises ``AttributeError`` naming the package.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


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
