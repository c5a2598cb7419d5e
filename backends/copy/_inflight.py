"""FIFO bookkeeping of submitted copies: handles, completion events, buffers kept alive, and their own time."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from kvkit._lazy import lazy_module
from kvkit.errors import PlanError

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # torch on first use: host-only copies import none

__all__ = ["HandleQueue", "InFlight", "Stopwatch", "StreamClock", "launch_stages", "recorded"]


class _Timed(Protocol):
    def elapsed_time(self, end: Any) -> float: ...


@attrs.define(eq=False)
class StreamClock:
    """The own time of one copy on a CUDA stream: spans of timing events around its work.

    A span starts when the stream reaches the copy (and again after every wait
    on another stream's event, so waiting is never counted) and ends with the
    last stage before the next start. Read :meth:`seconds` only once the
    copy's last event completed.
    """

    spans: list[list[Any]] = attrs.field(factory=list)  # [start event, end event]

    def start(self, event: _Timed) -> None:
        """A span starts at ``event`` (recorded, with timing, where the work begins)."""
        self.spans.append([event, None])

    def stop(self, event: _Timed) -> None:
        """The current span ends at ``event`` (recorded, with timing, after the work so far)."""
        self.spans[-1][1] = event

    def seconds(self) -> float:
        """Seconds the stream spent on the copy's spans."""
        return 1e-3 * sum(start.elapsed_time(end) for start, end in self.spans)


def recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """A timing event recorded on ``stream``: a stage's completion, and where a :class:`StreamClock` span ends
    or starts."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class Stopwatch(Protocol):
    """A copy's own time, read once its work completed (a :class:`StreamClock`, or a backend's own)."""

    def seconds(self) -> float: ...


def launch_stages(stream: torch.cuda.Stream, stages: list[range], waits: list[Any],
                  launch: Callable[[range], object]) -> tuple[list[tuple[Any, ...]], StreamClock]:
    """Launch each stage on ``stream`` (current) after its wait: one timing event per stage, and the clock of
    their work (a span from each start and each wait, so waiting is not counted). A raising ``launch``
    propagates: the caller makes sure nothing of the plan keeps running."""
    events: list[tuple[Any, ...]] = []
    clock = StreamClock()
    for i, (stage, wait) in enumerate(zip(stages, waits)):
        if wait is not None:
            stream.wait_event(wait)
        if wait is not None or not i:
            clock.start(recorded(stream))
        launch(stage)
        event = recorded(stream)
        clock.stop(event)
        events.append((event,))
    return events, clock


Clock = float | Future | Stopwatch  # a copy's own seconds: known, on a host thread, or read once it completed


def _seconds(clock: Clock) -> float:
    if isinstance(clock, float):
        return clock
    return clock.result() if isinstance(clock, Future) else clock.seconds()


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
        * A handle issued with a ``clock`` has its own seconds answered by
          :meth:`seconds` after the :meth:`poll` that reported it, until the
          next poll.
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
    _clocks: dict[int, Clock] = attrs.field(factory=dict, init=False)  # handles in flight that are timed
    _timed: dict[int, float] = attrs.field(factory=dict, init=False)  # own seconds of those retired
    _reported: dict[int, float] = attrs.field(factory=dict, init=False)  # own seconds of the last poll's

    def issue(self, event: Any = None, keep_alive: Any = None,
              then: Callable[[], object] | None = None, clock: Clock | None = None) -> int:
        """A new handle that completes with ``event``.

        Args:
            event: a recorded ``torch.cuda.Event``; ``None`` if the work already finished.
            keep_alive: what the device may still read until ``event`` completed.
            then: host work that runs once ``event`` completed, before the handle is reported.
            clock: the copy's own time (read once ``event`` completed); ``None``: not timed.
        """
        handle = self._next
        self._next += 1
        if clock is not None:
            self._clocks[handle] = clock
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
            clock = self._clocks.pop(handle, None)
            if clock is not None:
                with contextlib.suppress(Exception):  # a clock that cannot be read leaves the copy untimed
                    self._timed[handle] = _seconds(clock)

    def poll(self) -> list[int]:
        """Handles completed since the last call, in order (non-blocking)."""
        while self._pending and (self._pending[0][1] is None or self._pending[0][1].query()):
            self._retire(self._pending.popleft())
        done, self._done = self._done, []
        self._reported, self._timed = self._timed, {}
        return done

    def seconds(self, handle: int) -> float | None:
        """The own seconds of ``handle`` if the last :meth:`poll` reported it and it was timed, else ``None``."""
        return self._reported.get(handle)

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
    """``poll``, ``wait`` and ``copy_seconds`` of a copy backend, answered by its ``_inflight`` queue."""

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

    def copy_seconds(self, handle: int) -> float | None:
        """:class:`~kvkit.interfaces.capabilities.TimedCopy`: the own seconds of ``handle``, reported by the
        last :meth:`poll` (``None``: another poll's, or not timed)."""
        return self._inflight.seconds(handle)
