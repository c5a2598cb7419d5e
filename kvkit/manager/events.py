"""The one dispatcher of :class:`~kvkit.interfaces.OffloadCallback` hooks."""

from __future__ import annotations

import attrs

from kvkit.interfaces.callbacks import OffloadCallback

__all__ = ["Events"]


@attrs.frozen
class Events:
    """Calls one hook on every callback, in order.

    Invariants: callbacks only observe; nothing in kvkit depends on what a
    hook does.
    """

    callbacks: tuple[OffloadCallback, ...] = ()

    def emit(self, hook: str, *args: object) -> None:
        """Call ``hook(*args)`` (an ``OffloadCallback`` method name) on each callback."""
        for cb in self.callbacks:
            getattr(cb, hook)(*args)
