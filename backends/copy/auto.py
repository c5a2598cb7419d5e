"""``AutoCopy``: routes each plan to the copy engines or to the copy kernel by its piece sizes.

The rule, from measurements on an H200 (PCIe Gen5, Llama-3-8B shapes;
BENCHMARKS.md, "GPU copy backends"):

1. Mean bytes per engine operation (after coalescing runs of consecutive
   blocks) of at least ``dma_min_bytes`` (256 KiB; cross-layer blocks are
   2 MiB, a run of 8 per-layer pieces 256 KiB): the copy engines
   (``cuda-dma``). They reach the PCIe limit (54-55 GB/s per direction,
   96 GB/s both ways) and take no SM.
2. Smaller pieces: the copy kernel (``cupy-batch``, 2 SMs, bulk copies), for
   stores and loads alike. On 32 KiB pieces it moved 50-52 GB/s per direction
   and slowed a concurrent GEMM 1.03-1.06x; the engines moved 33-52 GB/s
   depending on the machine and direction, spent ~0.4-1.1 us of host time per
   piece, and, with loads on the engines while the kernel stored, both
   directions together fell to 54 GB/s (kernel both ways: 65 GB/s).
   ``small_loads="dma"`` sends small loads to the engines anyway (no SM).

With ``kernel_share`` > 0, kernel-bound plans are split instead: that share of
the blocks goes to the kernel, the rest to the engines, both at once (more
bytes per second when both directions run, but a GEMM beside it slowed 1.6x).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from typing_extensions import override

from kvkit.backends.copy._inflight import HandleQueue, InFlight
from kvkit.backends.copy.planner import Planner, registered, stage_waits
from kvkit.errors import BackendUnavailableError
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import Direction, TransferPlan
from kvkit.validate import one_of, real_in

__all__ = ["AutoCopy"]


@attrs.frozen(eq=False)
class _Parts:
    """One handle's inner copies ``(backend index, inner handle)``, as an event :class:`InFlight` waits on."""

    parts: list[tuple[int, int]]
    backends: list[Any]
    seen: list[int]  # shared with AutoCopy: per backend, the highest handle known complete

    def query(self) -> bool:
        return all(h <= self.seen[i] for i, h in self.parts)

    def synchronize(self) -> None:
        for i, h in self.parts:
            if h > self.seen[i]:
                self.backends[i].wait(h)
                self.seen[i] = h


@attrs.frozen(eq=False)
class _PartsClock:
    """A handle's own time: the longest of its inner copies' (they run side by side), as the inner backends'
    polls reported them; unreadable (the copy untimed) when one was not timed or was waited for instead."""

    parts: list[tuple[int, int]]
    timed: dict[tuple[int, int], float | None]  # shared with AutoCopy: inner copies awaited, their seconds once polled

    def seconds(self) -> float:
        found = [self.timed.pop(part, None) for part in self.parts]
        if any(s is None for s in found):
            raise LookupError("an inner copy was not timed")
        return max(s for s in found if s is not None)


@attrs.define(eq=False)
class AutoCopy(HandleQueue, CopyBackend):
    """Chooses ``cuda-dma`` or ``cupy-batch`` per plan (or splits it between them).

    Args:
        sm_budget: SMs the copy kernel may take (``cupy-batch``'s setting).
        dma_min_bytes: mean bytes per engine operation from which a plan goes
            to the copy engines.
        small_loads: where loads of smaller pieces go: ``"dma"`` or ``"kernel"``.
        kernel_share: if > 0, a kernel-bound plan is split: this share of its
            blocks goes to the kernel, the rest to the engines, at once.
        strided: ``cuda-dma``'s setting (2-D copies across evenly spaced regions).
        dma: the engine backend (default: a ``CudaDMACopy`` if available).
        kernel: the kernel backend (default: a ``CupyBatchCopy`` if available).

    Invariants:
        * Handles are reported by :meth:`poll` exactly once, in submission
          order, once every part of the plan completed.
        * A plan is validated in full before any part of it is launched; a
          ``submit`` that raises leaves no part of it running.
        * A handle's ``copy_seconds`` (:class:`~kvkit.interfaces.capabilities.TimedCopy`)
          is the longest of its parts' own times, when the inner backends
          timed them and their polls reported them before it completed
          (not after a :meth:`wait`).

    Raises:
        BackendUnavailableError: neither inner backend can run here.
    """

    sm_budget: int = 2
    dma_min_bytes: int = 256 << 10
    small_loads: str = attrs.field(default="kernel", validator=one_of(("dma", "kernel"), label="auto: "))
    kernel_share: float = attrs.field(default=0.0, validator=real_in(low=0, high=1, high_open=True, label="auto: "))
    strided: bool = False
    dma: Any = None
    kernel: Any = None
    _planner: Planner | None = attrs.field(default=None, init=False)
    _backends: list[Any] = attrs.field(factory=list, init=False)
    _seen: list[int] = attrs.field(factory=list, init=False)  # per backend: highest completed handle
    _timed: dict[tuple[int, int], float | None] = attrs.field(factory=dict, init=False)  # see _PartsClock
    _inflight: InFlight = attrs.field(factory=InFlight, init=False)

    def __attrs_post_init__(self) -> None:
        if self.dma is None and self.kernel is None:
            from kvkit.backends.copy.cuda_dma import CudaDMACopy
            from kvkit.backends.copy.cupy_batch import CupyBatchCopy

            if CudaDMACopy.is_available():
                self.dma = CudaDMACopy(strided=self.strided)
            if CupyBatchCopy.is_available():
                self.kernel = CupyBatchCopy(sm_budget=self.sm_budget)
        self._backends = [b for b in (self.dma, self.kernel) if b is not None]
        if not self._backends:
            raise BackendUnavailableError("auto: neither cuda-dma nor cupy-batch can run on this machine")
        self._seen = [-1] * len(self._backends)

    @classmethod
    @override
    def is_available(cls) -> bool:
        """``cuda-dma`` or ``cupy-batch`` can run here."""
        from kvkit.backends.copy.cuda_dma import CudaDMACopy
        from kvkit.backends.copy.cupy_batch import CupyBatchCopy

        return CudaDMACopy.is_available() or CupyBatchCopy.is_available()

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why neither GPU backend can run here (``kvkit list`` shows it), or ``None``."""
        from kvkit.backends.copy.cuda_dma import CudaDMACopy
        from kvkit.backends.copy.cupy_batch import CupyBatchCopy

        reasons = [CudaDMACopy.unavailable_reason(), CupyBatchCopy.unavailable_reason()]
        return None if None in reasons else f"cuda-dma: {reasons[0]}; cupy-batch: {reasons[1]}"

    @property
    def planner(self) -> Planner | None:
        """The planner of the current registration (used to choose, and to validate first)."""
        return self._planner

    @override
    def register(self, regions: Sequence[Region]) -> None:
        """Register ``regions`` with every inner backend (see their ``register``)."""
        for b in self._backends:
            b.register(regions)
        self._planner = Planner.of(regions)

    def choose(self, plan: TransferPlan) -> str:
        """``"dma"``, ``"kernel"`` or ``"split"``: where ``plan`` goes (it must be valid)."""
        if self.kernel is None:
            return "dma"
        if self.dma is None:
            return "kernel"
        assert self._planner is not None
        strided = self._planner.strided(plan) if self.strided else None
        ops, nbytes = (len(strided), strided.nbytes) if strided is not None else self._planner.count(plan)
        if ops == 0 or nbytes / ops >= self.dma_min_bytes:
            return "dma"
        if plan.direction is Direction.LOAD and self.small_loads == "dma":
            return "dma"
        return "split" if self.kernel_share > 0 and len(plan) > 1 else "kernel"

    @override
    def submit(self, plan: TransferPlan, *, after: Any = None) -> int:
        """Validate ``plan``, then launch it on the chosen backend(s); returns its handle.

        Raises:
            PlanError: as the inner backends; nothing was launched.
        """
        registered(self._planner, plan)
        return self._start(plan, lambda backend, part: (backend.submit(part, after=after), []))[0]

    def submit_stages(self, plan: TransferPlan, stages: Sequence[range], *,
                      after: Any = None) -> tuple[int, list[tuple[Any, ...]]]:
        """:class:`~kvkit.interfaces.capabilities.LayeredCopy` through the inner backends' own (both must have it).

        A split plan's stage completes once both backends' parts of it did.

        Raises:
            PlanError: as :meth:`submit`, or as the inner backends' ``submit_stages``; nothing was launched.
        """
        stages = registered(self._planner, plan).stages(plan, stages)
        stage_waits(after, len(stages))  # a bad ``after`` fails before any part launches
        return self._start(plan, lambda backend, part: backend.submit_stages(part, stages, after=after))

    def _start(self, plan: TransferPlan, launch: Any) -> tuple[int, list[tuple[Any, ...]]]:
        """Launch ``plan``'s part(s) with ``launch(backend, part) -> (handle, stage events)``."""
        where = self.choose(plan)
        if where == "split":
            k = max(1, min(len(plan) - 1, round(len(plan) * self.kernel_share)))
            parts = [(self.kernel, plan.src[:k], plan.dst[:k]), (self.dma, plan.src[k:], plan.dst[k:])]
        else:
            parts = [(self.dma if where == "dma" else self.kernel, plan.src, plan.dst)]
        inner: list[tuple[int, int]] = []
        events: list[tuple[Any, ...]] = []
        for backend, src, dst in parts:
            part = plan if len(parts) == 1 else TransferPlan(src, dst, plan.direction, plan.group)
            try:
                handle, stage_events = launch(backend, part)
            except Exception:
                _Parts(inner, self._backends, self._seen).synchronize()  # a raising submit leaves nothing running
                raise
            inner.append((self._backends.index(backend), handle))
            events = [a + b for a, b in zip(events, stage_events)] if events else list(stage_events)
        self._timed.update(dict.fromkeys(inner))
        return self._inflight.issue(_Parts(inner, self._backends, self._seen), clock=_PartsClock(inner, self._timed)), \
            events

    @override
    def poll(self) -> list[int]:
        """Handles completed since the last call, in submission order (non-blocking)."""
        for i, b in enumerate(self._backends):
            done = b.poll()
            if done:
                self._seen[i] = max(self._seen[i], max(done))
                for h in done:
                    if (i, h) in self._timed:
                        self._timed[(i, h)] = b.copy_seconds(h)
        return super().poll()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if handle bookkeeping is inconsistent."""
        self._inflight.check_invariants()
        for b in self._backends:
            b.check_invariants()
