"""The one dispatcher of :class:`~kvkit.interfaces.OffloadCallback` hooks."""

from __future__ import annotations

import attrs

from kvkit.interfaces.callbacks import OffloadCallback
from kvkit.redact import redact_text
from kvkit.stats import Counter
from kvkit.warn import warn

__all__ = ["Events"]


@attrs.define(eq=False)
class Events:
    """Calls one hook on every callback, in order, and contains what a callback raises.

    Invariants: callbacks only observe. An exception a hook raises never
    reaches kvkit's control flow: it is counted in ``errors``, reported once
    per callback and hook as a ``RuntimeWarning``, and the remaining
    callbacks still run, so the state the event describes is the same
    whatever a callback does. :meth:`contain` does the same for the manager's
    other user components (the store policy).
    """

    callbacks: tuple[OffloadCallback, ...] = ()
    errors: Counter = attrs.field(factory=Counter)
    _warned: set[tuple[int, str]] = attrs.field(init=False, factory=set)

    def emit(self, hook: str, *args: object) -> None:
        """Call ``hook(*args)`` (an ``OffloadCallback`` method name) on each callback."""
        for cb in self.callbacks:
            try:
                getattr(cb, hook)(*args)
            except Exception as exc:  # noqa: BLE001 - an observer's bug must not wedge the manager
                self.contain(cb, hook, exc, self.errors, "callback_errors")

    def contain(self, component: object, hook: str, exc: Exception, counter: Counter, name: str) -> None:
        """Count ``exc`` (raised by ``component.hook``) in ``counter`` and warn once per component and hook."""
        counter.add()
        key = (id(component), hook)
        if key not in self._warned:
            self._warned.add(key)
            warn(redact_text(f"{type(component).__qualname__}.{hook} raised {type(exc).__name__}: {exc} "
                             f"(contained: kvkit's state is unaffected; counted in stats.{name})"), RuntimeWarning)
