"""``DriveLock``: one thread drives a stack at a time, and nothing drives it once it is closed.

Rules:

* A thread *holds* the lock for a call (``with lock:`` or a :func:`driven`
  method) or for a whole engine step; while it holds it, every other
  thread's hold waits.
* Holds nest on their thread: a call made inside a held one (a step's
  manager calls) enters at once.
* :meth:`DriveLock.shut` refuses every later outermost hold
  (``RequestStateError``); it waits, bounded, for another thread's holder to
  let go (that holder's nested holds still enter: its step runs to its end),
  and holds the lock itself until :meth:`DriveLock.release`. On the thread
  that shut it, from inside a hold of its own, the nested holds after
  ``shut``'s are refused too.
* A hold costs two C calls (the ownership test and the re-entrant lock) and
  one flag read while the lock is open; only a shut lock takes the slow path.
* Fork: in a child process, a lock held by a thread of the parent that did
  not fork (one that does not exist there) is free; the forking thread's own
  hold carries on.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from kvkit.errors import RequestStateError

__all__ = ["DriveLock", "driven"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class DriveLock:
    """The lock one stack's drivers and its ``close`` share (see the module's rules)."""

    __slots__ = ("__weakref__", "_closer", "_closing", "closed", "lock")

    def __init__(self) -> None:
        self.lock: Any = threading.RLock()  # CPython's C RLock: acquire, release and _is_owned
        self.closed = False
        self._closer: int | None = None  # the thread that called shut()
        self._closing = False  # shut()'s own hold lasts: holds nested in it enter
        _LOCKS.add(self)

    def __enter__(self) -> DriveLock:
        """Hold the lock (nested holds of one thread enter at once).

        Raises:
            RequestStateError: :meth:`shut` was called before this outermost hold, or this thread shut the
                lock and this hold is not inside ``shut``'s.
        """
        outer = not self.lock._is_owned()
        self.lock.acquire()
        if self.closed:
            try:
                self.admit(outer)
            except RequestStateError:
                self.lock.release()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.lock.release()

    def admit(self, outer: bool) -> None:
        """Refuse a hold of a shut lock (this thread holds it now) unless it nests in a step that was running
        when another thread shut it, or in ``shut``'s own hold."""
        if outer or (self._closer == threading.get_ident() and not self._closing):
            raise RequestStateError("the stack is closed; build a new one")

    def shut(self, timeout: float) -> bool:
        """Refuse every later outermost hold, then hold the lock once another thread's holder let go, waiting
        at most ``timeout`` seconds; whether it holds it (then :meth:`release` it)."""
        self.closed = True
        self._closer = threading.get_ident()
        if not self.lock.acquire(timeout=min(max(timeout, 0.0), threading.TIMEOUT_MAX)):
            return False
        self._closing = True
        return True

    def release(self) -> None:
        """End ``shut``'s hold."""
        self._closing = False
        self.lock.release()


_LOCKS: weakref.WeakSet[DriveLock] = weakref.WeakSet()


def _free_in_child() -> None:
    """After a fork, in the child: free every lock a thread other than the forking one held."""
    for drive in list(_LOCKS):
        if drive.lock.acquire(blocking=False):  # free, or held by the forking thread (re-entrant)
            drive.lock.release()
        else:  # held by a thread that does not exist here
            drive.lock = threading.RLock()


os.register_at_fork(after_in_child=_free_in_child)


class _Driven(Protocol):
    @property
    def drive_lock(self) -> DriveLock: ...


_S = TypeVar("_S", bound=_Driven)


def driven(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """``method`` run while holding its instance's ``drive_lock`` (the rules' fast path, inlined)."""

    @functools.wraps(method)
    def call(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        drive = self.drive_lock
        outer = not drive.lock._is_owned()
        with drive.lock:
            if drive.closed:
                drive.admit(outer)
            return method(self, *args, **kwargs)

    return call
