"""``ThreadedCopy``: a copy backend on a host thread pool whose copies land late on demand and whose poll fails.

For tests of what drives a copy backend (kvkit's ``TransferEngine``, an
engine's connector). Its copies run outside the caller's thread, like a
backend on a host thread pool or a future non-CUDA tier, so a copy may still
write after the backend raised an error: the case where freeing the copy's
blocks on the error would let the late copy corrupt whatever reuses them.
Both tiers must be host memory; bytes really move::

    backend = ThreadedCopy()
    gate = backend.hold()                 # copies submitted from now on wait for the gate
    ...                                   # submit copies
    backend.poll_error = RuntimeError("device lost")  # poll() and wait() raise it
    backend.poll_error = None
    gate.set()                            # the held copies land now
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from typing_extensions import override

from kvkit.backends.copy.planner import Planner, registered
from kvkit.errors import PlanError, SpecMismatchError
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import Direction, TransferPlan
from kvkit.validate import check_int, check_real, checked

__all__ = ["ThreadedCopy"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[num_blocks, piece bytes]`` uint8 (index ops exist for every dtype as bytes)."""
    return (t.unsqueeze(1) if t.dim() == 1 else t).flatten(1).view(torch.uint8)


@attrs.define(eq=False)
class ThreadedCopy(CopyBackend):
    """Copies block pieces on a ``concurrent.futures.ThreadPoolExecutor``, with faults on demand.

    Args:
        threads: pool threads; copies run concurrently and may land out of order.
        max_hold_s: the longest a held copy waits for its gate, so a forgotten
            gate cannot hang the interpreter at exit (which joins pool threads).

    Attributes:
        gate: copies submitted while it is an event wait for it before copying
            (see :meth:`hold`); ``None``: they copy at once.
        poll_error: while not ``None``, :meth:`poll` and :meth:`wait` raise it;
            copies keep running (a device error the backend cannot attribute).
        plans: the plan of each handle, by handle.
        log: ``("submit", handle)`` and ``("land", handle)`` in the order they
            happened (a copy "lands" once its last byte was written).

    Invariants:
        * :meth:`poll` reports each handle once, in submission order, and only
          after its copy landed; a rejected plan writes nothing, issues no handle.
        * :meth:`submit` never raises but ``PlanError`` (nothing launched then).
    """

    threads: int = attrs.field(default=4, converter=checked(check_int, minimum=1, label="ThreadedCopy."))  # type: ignore[misc]
    max_hold_s: float = attrs.field(default=30.0, converter=checked(check_real, low=0, label="ThreadedCopy."))  # type: ignore[misc]
    gate: threading.Event | None = None
    poll_error: Exception | None = None
    plans: list[TransferPlan] = attrs.field(factory=list, init=False)
    log: list[tuple[str, int]] = attrs.field(factory=list, init=False)
    _pool: concurrent.futures.ThreadPoolExecutor = attrs.field(init=False)
    _planner: Planner | None = attrs.field(default=None, init=False)
    _regions: dict[int, list[Region]] = attrs.field(factory=dict, init=False)
    _futures: list[concurrent.futures.Future[None]] = attrs.field(factory=list, init=False)
    _reported: int = attrs.field(default=0, init=False)
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False)

    def __attrs_post_init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="kvkit-threaded-copy")

    @classmethod
    @override
    def is_available(cls) -> bool:
        """Always: it needs threads and torch on the host."""
        return True

    @override
    def register(self, regions: Sequence[Region]) -> None:
        """Register the regions plans copy; replaces any earlier registration.

        Raises:
            SpecMismatchError: duplicate names, or a tier not in host memory.
        """
        for r in regions:
            if r.gpu.device.type != "cpu":
                raise SpecMismatchError(f"ThreadedCopy copies host memory only; region {r.name!r} is on {r.gpu.device}")
        planner = Planner.of(regions)
        by_group: dict[int, list[Region]] = {}
        for r in regions:
            by_group.setdefault(r.group, []).append(r)
        self._planner, self._regions = planner, by_group

    def hold(self) -> threading.Event:
        """A fresh :attr:`gate`: copies submitted from now on wait until it is set (or :attr:`max_hold_s`)."""
        self.gate = threading.Event()
        return self.gate

    @override
    def submit(self, plan: TransferPlan, *, after: Any = None) -> int:
        """Validate ``plan`` and queue its copy on the pool; returns its handle.

        Raises:
            PlanError: as every built-in backend; nothing was queued.
        """
        registered(self._planner, plan)
        handle = len(self._futures)
        self.plans.append(plan)
        with self._lock:
            self.log.append(("submit", handle))
        self._futures.append(self._pool.submit(self._copy, handle, plan, self._regions[plan.group], self.gate))
        return handle

    def _copy(self, handle: int, plan: TransferPlan, regions: list[Region], gate: threading.Event | None) -> None:
        if gate is not None:
            gate.wait(self.max_hold_s)
        src_ids, dst_ids = torch.tensor(plan.src), torch.tensor(plan.dst)
        store = plan.direction is Direction.STORE
        for r in regions:
            src, dst = (_rows(r.gpu), _rows(r.cpu)) if store else (_rows(r.cpu), _rows(r.gpu))
            dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))
        with self._lock:
            self.log.append(("land", handle))

    def landed(self, handle: int, timeout: float = 0.0) -> bool:
        """Whether ``handle``'s copy landed, waiting at most ``timeout`` seconds for it."""
        concurrent.futures.wait([self._futures[handle]], timeout=timeout)
        return self._futures[handle].done()

    @override
    def poll(self) -> list[int]:
        """Handles whose copies landed since the last call, in submission order (non-blocking).

        Raises:
            Exception: :attr:`poll_error`, while set; or the error a copy raised
                (its handle then stays unreported: the backend is broken).
        """
        if self.poll_error is not None:
            raise self.poll_error
        done = []
        while self._reported < len(self._futures) and self._futures[self._reported].done():
            self._futures[self._reported].result()
            done.append(self._reported)
            self._reported += 1
        return done

    @override
    def wait(self, handle: int) -> None:
        """Block until ``handle`` and every earlier handle landed.

        Raises:
            PlanError: ``handle`` was never issued.
            Exception: as :meth:`poll`.
        """
        if not 0 <= handle < len(self._futures):
            raise PlanError(f"unknown copy handle {handle!r}; issued 0..{len(self._futures) - 1}")
        if self.poll_error is not None:
            raise self.poll_error
        for future in self._futures[:handle + 1]:
            future.result()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if handle bookkeeping is inconsistent."""
        assert 0 <= self._reported <= len(self._futures) == len(self.plans)
        assert all(f.done() for f in self._futures[:self._reported]), "a handle was reported before it landed"
        with self._lock:
            landed = [h for event, h in self.log if event == "land"]
        assert len(set(landed)) == len(landed), f"a copy landed twice: {landed}"
