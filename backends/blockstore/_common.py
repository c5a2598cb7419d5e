"""What every block store shares: argument checks, the ticket box where results wait for their owners, and what a
forked child lets go of."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Collection, Sequence
from typing import Protocol

import attrs

from kvkit.errors import ConfigError, KVKitError
from kvkit.interfaces.shared import StoreResult
from kvkit.validate import check_real, plural, quote

__all__ = ["MAX_WAITING", "Descriptors", "TicketBox", "carry_through_fork", "check_call", "check_keys", "check_timeout",
           "flat_views", "wanted_tickets"]


def check_keys(store: str, closed: bool, keys: Sequence[bytes]) -> None:
    """Refuse a call on a closed store, with keys that are not a sequence, or with a key that is not ``bytes``."""
    if closed:
        raise KVKitError(f"{store} is closed")
    if not isinstance(keys, Sequence) or isinstance(keys, str | bytes):
        raise ConfigError(f"block-store keys must be a sequence (a list) of non-empty bytes, got {quote(keys)}")
    for key in keys:
        if not isinstance(key, bytes) or not key:
            raise ConfigError(f"a block-store key must be non-empty bytes, got {quote(key)}")


def check_timeout(store: str, timeout_s: object) -> float | None:
    """A ``contains`` call's ``timeout_s``: ``None`` (the store's own deadline) or seconds >= 0 as a ``float``;
    ``ConfigError`` quoting anything else (NaN included)."""
    return None if timeout_s is None else check_real(f"{store}.contains timeout_s", timeout_s, low=0.0)


def check_call(store: str, closed: bool, keys: Sequence[bytes],
               buffers: Sequence[Sequence[memoryview]]) -> list[list[memoryview]]:
    """Each value's byte views (:func:`flat_views`) for a ``put``/``get``, or ``ConfigError`` quoting what is bad.

    A store calls it before it issues a ticket or changes a value: a call it
    refuses leaves no ticket open and nothing written.
    """
    check_keys(store, closed, keys)
    if not isinstance(buffers, Sequence):
        raise ConfigError(f"block-store buffers must be a sequence of buffer lists, one per key, got {quote(buffers)}")
    if len(keys) != len(buffers):
        raise ConfigError(f"{plural(len(keys), 'key')} but {plural(len(buffers), 'buffer list')}")
    return [flat_views(parts) for parts in buffers]


def flat_views(parts: Sequence[memoryview]) -> list[memoryview]:
    """Byte views of one value's buffers (each contiguous), in order; ``ConfigError`` quoting anything else."""
    try:
        return [memoryview(p).cast("B") for p in parts]
    except (TypeError, ValueError) as exc:  # not a buffer, not C-contiguous, not a list of them
        raise ConfigError(f"a value's buffers must be a list of C-contiguous bytes-like objects, "
                          f"got {quote(parts)} ({exc})") from None


MAX_WAITING = 1 << 14
"""Finished results a built-in store keeps for their owners' polls, by default (``max_waiting``)."""


def wanted_tickets(tickets: object) -> set[int]:
    """The tickets a ``poll`` names, as a set; ``ConfigError`` quoting anything but a collection of ints."""
    if isinstance(tickets, Collection) and not isinstance(tickets, str | bytes):
        wanted = set(tickets)
        if all(t.__class__ is int for t in wanted):
            return wanted
    raise ConfigError(f"poll(tickets={quote(tickets)}): tickets must be a collection of ints (those put/get answered)")


@attrs.define(eq=False)
class TicketBox:
    """Tickets handed out, and finished results waiting for the poll that names them; thread-safe.

    Invariants: every issued ticket is reported at most once, and only to a
    poll naming it (a result for a ticket already finished, e.g. failed by
    :meth:`fail_open`, is dropped); at most ``max_waiting`` results wait: one
    more finishing discards the one that waited longest (its ticket is
    abandoned, counted in ``abandoned``).
    """

    max_waiting: int = MAX_WAITING
    abandoned: int = attrs.field(default=0, init=False)
    _next: int = attrs.field(default=0, init=False)
    _open: dict[int, int] = attrs.field(factory=dict, init=False)  # ticket -> its number of keys
    _done: dict[int, StoreResult] = attrs.field(factory=dict, init=False)  # in the order they finished
    _cond: threading.Condition = attrs.field(factory=threading.Condition, init=False)

    def issue(self, n_keys: int) -> int:
        """A fresh ticket for a call of ``n_keys`` keys, open until reported."""
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._open[ticket] = n_keys
            return ticket

    def report(self, ticket: int, failed: Sequence[int] = (), error: str = "",
               unreached: Sequence[int] | None = None, unsent: Sequence[int] | None = None) -> None:
        """Keep the result of ``ticket`` for its owner's poll unless it already finished (``unreached``, ``unsent``:
        as :attr:`StoreResult.unreached` and :attr:`StoreResult.unsent`)."""
        with self._cond:
            if self._open.pop(ticket, None) is None:
                return
            self._keep(StoreResult(ticket, failed, error if failed else "", unreached, unsent))
            self._cond.notify_all()

    def fail_open(self, error: str) -> None:
        """Finish every open ticket failed, all of its keys, with ``error``."""
        with self._cond:
            for ticket, n_keys in sorted(self._open.items()):
                self._keep(StoreResult(ticket, range(n_keys), error))
            self._open.clear()
            self._cond.notify_all()

    def after_fork(self, error: str) -> None:
        """In a child forked while the box was in use: a fresh lock (the one copied may be held by a thread
        that is not in this process), and every open ticket failed with ``error`` (no thread here serves it)."""
        self._cond = threading.Condition()
        self.fail_open(error)

    def poll(self, tickets: object, timeout: float = 0.0) -> list[StoreResult]:
        """The finished results of ``tickets`` (by ticket), waiting up to ``timeout`` seconds for the first
        (any length: ``math.inf`` waits until one is reported).

        Raises:
            ConfigError: ``tickets`` is not a collection of ints, or ``timeout`` is negative.
        """
        wanted = wanted_tickets(tickets)
        timeout = check_real("poll timeout", timeout, low=0.0)
        deadline = time.monotonic() + timeout
        with self._cond:
            while wanted.isdisjoint(self._done) and not wanted.isdisjoint(self._open):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, threading.TIMEOUT_MAX))  # a longer wait is an OverflowError
            return [self._done.pop(t) for t in sorted(wanted.intersection(self._done))]

    @property
    def outstanding(self) -> int:
        """Tickets issued and not finished yet."""
        with self._cond:
            return len(self._open)

    @property
    def waiting(self) -> int:
        """Finished results no poll has named yet."""
        with self._cond:
            return len(self._done)

    def check_invariants(self) -> None:
        """Assert the bound on waiting results and that no ticket is both open and finished."""
        with self._cond:
            assert len(self._done) <= self.max_waiting, "more results wait than max_waiting"
            assert self._open.keys().isdisjoint(self._done), "a ticket is both open and finished"

    def _keep(self, result: StoreResult) -> None:
        while len(self._done) >= self.max_waiting:
            del self._done[next(iter(self._done))]
            self.abandoned += 1
        self._done[result.ticket] = result


class Descriptors:
    """File descriptors that calls hold open, so that a child forked while they run closes its copies of them
    (:meth:`close_copies`): no call runs on there to close them, and a copy keeps what it refers to alive for as
    long as the child lives (a socket's connection, a file's ``flock`` and, once deleted, its space).

    A descriptor is held from just after it is opened until just before it is closed (or handed to an owner that
    lets go of it in a child, as a connection does), so every number held at a fork is one of the calls' in the
    child: a number closed and reused in between is never closed there.
    """

    __slots__ = ("fds",)

    def __init__(self) -> None:
        self.fds: set[int] = set()

    def hold(self, fd: int) -> int:
        self.fds.add(fd)
        return fd

    def let_go(self, fd: int) -> None:
        self.fds.discard(fd)

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        """``os.open``, the descriptor held."""
        return self.hold(os.open(path, flags, mode, dir_fd=dir_fd))

    def close(self, fd: int) -> None:
        """Let go of ``fd``, then close it."""
        self.let_go(fd)
        os.close(fd)

    def close_copies(self) -> None:
        """In a forked child: close the copies of the descriptors held at the fork."""
        for fd in list(self.fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


class _Forkable(Protocol):
    def _forked(self, parent: int) -> None: ...


_LIVE: weakref.WeakSet[_Forkable] = weakref.WeakSet()


def carry_through_fork(store: _Forkable) -> None:
    """Have ``store._forked(parent)`` called in every child forked while it lives (``parent``: the forking
    process's id), before anything else runs there: the store's threads and the locks they held are not in the
    child, so the store lets go of them there."""
    _LIVE.add(store)


def _after_fork_in_child() -> None:
    for store in list(_LIVE):
        store._forked(os.getppid())


os.register_at_fork(after_in_child=_after_fork_in_child)
