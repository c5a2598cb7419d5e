"""Compiled twins of the per-block loops, and which of the two a new object runs.

A hot per-block loop has a Python *reference*, which holds its contract, and
may have a *compiled* twin of the same contract: a C extension module built
at install where a C compiler is (an optional extension: without one the
install goes on and the references run). A :class:`Twins` holds both sets of
one module's loops, each a named tuple of functions (where an object's own
methods are the reference, as the block pool's are, its reference set is
``None``: the methods run when the set is ``None``). An object that runs such loops keeps the set it runs in
a per-instance field, filled at construction by :meth:`Twins.default`:

* the compiled set where it was built and :data:`PREFER_COMPILED` is true,
* else the reference set.

The tests set that field to :attr:`Twins.reference` on one of two objects
driven alike and compare their whole state after every call; a test that
counts the Python lines a call runs clears :data:`PREFER_COMPILED` (a loop in
C hides its work from a line counter).
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

import attrs

__all__ = ["PREFER_COMPILED", "Twins", "compiled"]

PREFER_COMPILED = True
"""Whether :meth:`Twins.default` gives the compiled set where it was built (objects made later)."""

_Loops = TypeVar("_Loops")
_Set = TypeVar("_Set", bound=tuple[object, ...])


def compiled(kind: type[_Set], module: str) -> _Set | None:
    """The functions of the extension module named ``module`` that bear the names of ``kind``'s fields
    (``kind``: a named tuple of functions), as a ``kind``; ``None`` where the module was not built."""
    try:
        extension = importlib.import_module(module)
    except ImportError:  # built without a C compiler: the references run
        return None
    names: tuple[str, ...] = kind._fields  # type: ignore[attr-defined]  # a named tuple's
    return kind(*(getattr(extension, name) for name in names))


@attrs.frozen
class Twins(Generic[_Loops]):
    """The reference and compiled sets of one module's loops.

    Args:
        reference: the Python loops, the contract.
        compiled: the compiled loops of the same contract; ``None`` where the extension was not built.
    """

    reference: _Loops
    compiled: _Loops | None

    @staticmethod
    def load(reference: _Set, module: str) -> Twins[_Set]:
        """``reference`` (a named tuple of functions) and the set :func:`compiled` finds in ``module``."""
        return Twins(reference, compiled(type(reference), module))

    def default(self) -> _Loops:
        """The set a new object runs: the compiled one where it was built, unless :data:`PREFER_COMPILED`
        is false."""
        return self.compiled if self.compiled is not None and PREFER_COMPILED else self.reference
