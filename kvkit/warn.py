"""Warnings attributed to the caller's code: the first frame outside kvkit's own packages.

The number of kvkit frames between a warning and the code that caused it depends on the call path (a
callback's error reached through ``step``, ``drain``, ``close`` or a lookup; a store's warning raised at
start-up or on its I/O thread), so a fixed ``stacklevel`` names some internal line on most paths.
:func:`warn` walks the stack instead and attributes the warning to the first frame whose file lies outside
kvkit's packages (``kvkit``, ``kvkit.backends``, ``kvkit.interfaces``, wherever each is installed): the
location printed, and the module a ``-W``/``filterwarnings`` rule matches, are the caller's. A warning raised
on a thread kvkit started (a store's I/O thread) names the frame that runs the thread (``threading``'s), and
one whose whole stack is kvkit's names its outermost frame.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn"]

_PACKAGES = ("kvkit", "kvkit.backends", "kvkit.interfaces")


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)``, attributed to the first frame outside kvkit's packages."""
    warnings.warn(message, category, stacklevel=_outside_level())


def _outside_level() -> int:
    """The ``stacklevel`` of the first frame outside kvkit, as seen by :func:`warn`'s call of ``warnings.warn``."""
    own = _own_prefixes()
    frame = sys._getframe(2)  # the caller of warn()
    level = 2  # warnings.warn's 1 is warn() itself, 2 its caller
    while frame.f_code.co_filename.startswith(own) and frame.f_back is not None:
        frame = frame.f_back
        level += 1
    return level


def _own_prefixes() -> tuple[str, ...]:
    """The directories of kvkit's packages imported so far (no frame of one not imported can be on a stack)."""
    return tuple(os.path.join(os.path.abspath(path), "") for name in _PACKAGES
                 for path in getattr(sys.modules.get(name), "__path__", ()))
