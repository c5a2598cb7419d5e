"""Renamed spellings kept for one release: old keywords and values still work, and warn.

kvkit 0.1 gave Python, config, CLI and JSON one vocabulary (``block_size``,
``cpu_eviction``/``gpu_eviction``, ``pcie_gbps``, directions ``store``/``load``).
An old spelling that the README or a notebook used keeps working until the next
release: it warns with a :class:`DeprecationWarning` that points at the
caller's line, and giving the old and the new spelling with different values is
a :class:`~kvkit.errors.ConfigError` (equal values are accepted).

Invariants: an old keyword never reaches the wrapped callable; every use of
an old spelling warns exactly once per call.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvkit.errors import ConfigError

__all__ = ["rename_keywords", "renamed_keywords", "warn_renamed"]

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Warn that ``old`` is deprecated for ``new``; ``stacklevel`` as for ``warnings.warn`` from the caller."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=stacklevel + 1)


def rename_keywords(kwargs: dict[str, Any], renames: Mapping[str, str], *, where: str,
                    stacklevel: int = 2) -> dict[str, Any]:
    """``kwargs`` with every old keyword of ``renames`` (old -> new) moved to its new name, in place.

    Raises:
        ConfigError: an old and its new keyword were both given, with different values.
    """
    for old, new in renames.items():
        if old not in kwargs:
            continue
        value = kwargs.pop(old)
        warn_renamed(f"{where}({old}=...)", f"{new}=...", stacklevel=stacklevel + 1)
        if new in kwargs and not (kwargs[new] is value or kwargs[new] == value):
            raise ConfigError(f"{where}: {old}={value!r} (deprecated) and {new}={kwargs[new]!r} "
                              f"disagree; give only {new}")
        kwargs[new] = value
    return kwargs


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Decorator: a function or an ``attrs`` class still takes each ``old=new`` keyword's old name.

    On a class it wraps ``__init__`` (so ``attrs.evolve`` sees the new names
    only) and adds a read-only property under each old name that warns and
    returns the new attribute.
    """

    def decorate(target: F) -> F:
        if isinstance(target, type):
            init = target.__init__
            where = target.__name__

            @functools.wraps(init)
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                init(self, *args, **rename_keywords(kwargs, renames, where=where))

            target.__init__ = __init__
            for old, new in renames.items():
                setattr(target, old, _alias(f"{where}.{old}", f"{where}.{new}", new))
            return target

        where = target.__qualname__

        @functools.wraps(target)
        def call(*args: Any, **kwargs: Any) -> Any:
            return target(*args, **rename_keywords(kwargs, renames, where=where))

        return call  # type: ignore[return-value]

    return decorate


def _alias(old: str, new: str, attribute: str) -> property:
    def read(self: Any) -> Any:
        warn_renamed(old, new)
        return getattr(self, attribute)

    return property(read, doc=f"Deprecated: {new}.")
