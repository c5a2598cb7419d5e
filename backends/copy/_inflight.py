"""FIFO bookkeeping of submitted copies: handles, completion events, buffers kept alive."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import attrs

from kvkit.errors import PlanError

__all__ = ["HandleQueue", "InFlight"]


@attrs.define(eq=False)
class InFlight:
    """Handles ``0, 1, 2...`` in submission order, each with the event that marks its completion.

    Invariants:
        * :meth:`poll` reports every handle exactly once, in submission order,
          and only once its event and every earlier one completed.
        * What :meth:`issue` was asked to keep alive is released only after
          its event completed (the device may still read it before).
        * A handle's ``then`` runs once, after its event completed and before
          the handle is reported.
        * An error raised by an event's ``query``/``synchronize`` leaves its
          handle pending (retried by the next call); one raised by ``then``
          propagates once, and the handle is reported by the next call (the
          host work ran, nothing of it still runs).
    """

    # (handle, event or None, keep_alive, then)
    _pending: collections.deque[tuple[int, Any, Any, Callable[[], object] | None]] = attrs.field(
        factory=collections.deque, init=False)
    _done: list[int] = attrs.field(factory=list, init=False)
    _next: int = attrs.field(default=0, init=False)

    def issue(self, event: Any = None, keep_alive: Any = None,
              then: Callable[[], object] | None = None) -> int:
        """A new handle that completes with ``event``.

        Args:
            event: a recorded ``torch.cuda.Event``; ``None`` if the work already finished.
            keep_alive: what the device may still read until ``event`` completed.
            then: host work that runs once ``event`` completed, before the handle is reported.
        """
        handle = self._next
        self._next += 1
        self._pending.append((handle, event, keep_alive, then))
        if event is None and len(self._pending) == 1:
            self._retire(self._pending.popleft())  # nothing earlier to wait for
        return handle

    def _retire(self, entry: tuple[int, Any, Any, Callable[[], object] | None]) -> None:
        handle, _, _, then = entry
        try:
            if then is not None:
                then()
        finally:  # a failed ``then`` ran (and raises): nothing of it still runs, so the handle is done
            self._done.append(handle)

    def poll(self) -> list[int]:
        """Handles completed since the last call, in order (non-blocking)."""
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
            self._retire(self._pending.popleft())
        done, self._done = self._done, []
        return done

    def wait(self, handle: int) -> None:
        """Block until ``handle`` and every earlier handle completed.

        Raises:
            PlanError: ``handle`` was never issued.
        """
        if not 0 <= handle < self._next:
            raise PlanError(f"unknown copy handle {handle!r}; issued 0..{self._next - 1}")
        while self._pending and self._pending[0][0] <= handle:
            if self._pending[0][1] is not None:
                self._pending[0][1].synchronize()  # if this raises, the handle stays pending
            self._retire(self._pending.popleft())

    def __len__(self) -> int:
        """Handles not yet completed (as far as this object knows)."""
        return len(self._pending)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if handle bookkeeping is inconsistent."""
        order = self._done + [p[0] for p in self._pending]
        assert order == sorted(set(order)), order
        assert all(h < self._next for h in order), (order, self._next)


class HandleQueue:
    """``poll`` and ``wait`` of a copy backend, answered by its ``_inflight`` queue."""

    __slots__ = ()
    _inflight: InFlight

    def poll(self) -> list[int]:
        """Handles completed since the last call, in submission order (non-blocking)."""
        return self._inflight.poll()

    def wait(self, handle: int) -> None:
        """Block until ``handle`` and every earlier handle completed.

        Raises:
            PlanError: ``handle`` was never issued.
        """
        self._inflight.wait(handle)
