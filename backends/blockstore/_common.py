"""What every block store shares: argument checks and the ticket box that ``poll`` empties."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

import attrs

from kvkit.errors import ConfigError, KVKitError
from kvkit.interfaces.shared import StoreResult
from kvkit.validate import check_real, plural, quote

__all__ = ["TicketBox", "check_call", "check_keys", "flat_views"]


def check_keys(store: str, closed: bool, keys: Sequence[bytes]) -> None:
    """Refuse a call on a closed store or with a key that is not ``bytes``."""
    if closed:
        raise KVKitError(f"{store} is closed")
    for key in keys:
        if not isinstance(key, bytes) or not key:
            raise ConfigError(f"a block-store key must be non-empty bytes, got {quote(key)}")


def check_call(store: str, closed: bool, keys: Sequence[bytes], buffers: Sequence[Sequence[object]]) -> None:
    """Refuse a ``put``/``get`` whose keys are bad or whose buffer lists do not pair with them."""
    check_keys(store, closed, keys)
    if len(keys) != len(buffers):
        raise ConfigError(f"{plural(len(keys), 'key')} but {plural(len(buffers), 'buffer list')}")


def flat_views(parts: Sequence[object]) -> list[memoryview]:
    """Byte views of one value's buffers (each contiguous), in order."""
    return [memoryview(p).cast("B") for p in parts]


@attrs.define(eq=False)
class TicketBox:
    """Tickets handed out, and results waiting for ``poll``; thread-safe.

    Invariants: every issued ticket is reported exactly once (a result for a
    ticket already reported, e.g. failed by :meth:`fail_open`, is dropped).
    """

    _next: int = attrs.field(default=0, init=False)
    _open: dict[int, int] = attrs.field(factory=dict, init=False)  # ticket -> its number of keys
    _done: deque[StoreResult] = attrs.field(factory=deque, init=False)
    _cond: threading.Condition = attrs.field(factory=threading.Condition, init=False)

    def issue(self, n_keys: int) -> int:
        """A fresh ticket for a call of ``n_keys`` keys, open until reported."""
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            self._open[ticket] = n_keys
            return ticket

    def report(self, ticket: int, failed: Sequence[int] = (), error: str = "") -> None:
        """Queue the result of ``ticket`` for ``poll`` unless it was already reported."""
        with self._cond:
            if ticket not in self._open:
                return
            del self._open[ticket]
            self._done.append(StoreResult(ticket, failed, error if failed else ""))
            self._cond.notify_all()

    def fail_open(self, error: str) -> None:
        """Report every open ticket failed, all of its keys, with ``error``."""
        with self._cond:
            for ticket, n_keys in sorted(self._open.items()):
                self._done.append(StoreResult(ticket, range(n_keys), error))
            self._open.clear()
            self._cond.notify_all()

    def poll(self, timeout: float = 0.0) -> list[StoreResult]:
        """Every queued result, waiting up to ``timeout`` seconds for the first."""
        timeout = check_real("poll timeout", timeout, low=0.0)
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._done and self._open:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            done = list(self._done)
            self._done.clear()
            return done

    @property
    def outstanding(self) -> int:
        """Tickets issued and not reported yet."""
        with self._cond:
            return len(self._open)
