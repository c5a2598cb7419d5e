"""``Gate``: one thread drives a stack at a time, and nothing drives it once it is closed.

Rules:

* A thread *holds* the gate for a call (``with gate:``) or for a whole engine
  step; while it holds it, every other thread's hold waits.
* Holds nest on their thread: a call made inside a held one (a step's
  manager calls) enters at once.
* :meth:`Gate.shut` refuses every later outermost hold (``RequestStateError``);
  it waits, bounded, for another thread's holder to let go (that holder's
  nested holds still enter: its step runs to its end), and holds the gate
  itself until :meth:`Gate.release`. On the thread that shut it, from inside
  a hold of its own, the nested holds after ``shut``'s are refused too.
* The uncontended path is one lock acquire and release per outermost hold.
* Fork: in a child process, a gate held by a thread of the parent that did
  not fork (one that does not exist there) is free; the forking thread's own
  hold carries on.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from kvkit.errors import RequestStateError

__all__ = ["Gate", "gated"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Gate:
    """The lock one stack's drivers and its ``close`` share (see the module's rules)."""

    __slots__ = ("__weakref__", "_closer", "_depth", "_lock", "_owner", "_shut_depth", "closed")

    def __init__(self) -> None:
        self._free()
        self.closed = False
        self._closer: int | None = None  # the thread that holds or held shut()'s hold
        _GATES.add(self)

    def _free(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the holding thread's ident
        self._depth = 0
        self._shut_depth = 0  # the depth of the hold shut() took while it lasts (holds inside it enter), else 0

    def __enter__(self) -> Gate:
        """Hold the gate (nested holds of one thread enter at once).

        Raises:
            RequestStateError: :meth:`shut` was called before this outermost hold, or this thread shut the
                gate and this hold is not inside ``shut``'s.
        """
        me = threading.get_ident()
        if self._owner == me:
            if self._closer == me and not self._shut_depth:
                raise RequestStateError("the stack is closed; build a new one")
            self._depth += 1
            return self
        self._lock.acquire()
        if self.closed:
            self._lock.release()
            raise RequestStateError("the stack is closed; build a new one")
        self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def shut(self, timeout: float) -> bool:
        """Refuse every later outermost hold, then hold the gate once another thread's holder let go, waiting
        at most ``timeout`` seconds; whether it holds it (then :meth:`release` it)."""
        self.closed = True
        me = threading.get_ident()
        if self._owner != me:
            if not self._lock.acquire(timeout=min(max(timeout, 0.0), threading.TIMEOUT_MAX)):
                return False
            self._owner = me
        self._depth += 1
        self._shut_depth, self._closer = self._depth, me
        return True

    def release(self) -> None:
        """End this thread's innermost hold (the outermost one lets the next thread in)."""
        assert self._owner == threading.get_ident(), "released by a thread that does not hold the gate"
        if self._depth == self._shut_depth:
            self._shut_depth = 0
        self._depth -= 1
        if not self._depth:
            self._owner = None
            self._lock.release()


_GATES: weakref.WeakSet[Gate] = weakref.WeakSet()


def _free_in_child() -> None:
    """After a fork, in the child: free every gate a thread other than the forking one held."""
    me = threading.get_ident()
    for gate in list(_GATES):
        if gate._owner not in (None, me):
            gate._free()


os.register_at_fork(after_in_child=_free_in_child)


class _Gated(Protocol):
    @property
    def gate(self) -> Gate: ...


_S = TypeVar("_S", bound=_Gated)


def gated(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """``method`` run while holding its instance's ``gate``."""

    @functools.wraps(method)
    def call(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.gate:
            return method(self, *args, **kwargs)

    return call
