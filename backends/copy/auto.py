"""``AutoCopy``: routes each plan to the copy engines or to the copy kernel by its piece sizes.

The rule (measured on an H200, PCIe Gen5; BENCHMARKS.md, "GPU copy backends"):
the copy engines (``cuda-dma``) take no SM from the model and reach the PCIe
limit once each engine operation moves enough bytes, while for small pieces
their fixed cost per operation caps them far below it; the copy kernel
(``cupy-batch``) reaches the limit for any piece size but occupies
``sm_budget`` SMs. So a plan goes to the engines when its mean bytes per
engine operation (after coalescing runs, or per 2-D copy when the regions are
evenly spaced) reach ``dma_min_bytes``, else to the kernel. With
``kernel_share`` > 0, plans of small pieces are split instead: the kernel
moves that share of the blocks on its few SMs while the engines move the rest,
both at once.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from typing_extensions import override

from kvkit.backends.copy._planner import Planner
from kvkit.errors import BackendUnavailableError, ConfigError, PlanError
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import TransferPlan

__all__ = ["AutoCopy"]


def _share(inst: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"auto: kernel_share must be in [0, 1), got {value!r}")


@attrs.define(eq=False)
class AutoCopy:
    """Chooses ``cuda-dma`` or ``cupy-batch`` per plan (or splits it between them).

    Args:
        sm_budget: SMs the copy kernel may take (``cupy-batch``'s setting).
        dma_min_bytes: mean bytes per engine operation from which a plan goes
            to the copy engines.
        kernel_share: if > 0, a plan of small pieces is split: this share of
            its blocks goes to the kernel, the rest to the engines, at once.
        strided: let the engines copy one block across all evenly spaced
            regions as one 2-D operation (``cuda-dma``'s setting).
        dma: the engine backend (default: a ``CudaDMACopy`` if available).
        kernel: the kernel backend (default: a ``CupyBatchCopy`` if available).

    Invariants:
        * Handles are reported by :meth:`poll` exactly once, in submission
          order, once every part of the plan completed.
        * A plan is validated in full before any part of it is launched.

    Raises:
        BackendUnavailableError: neither inner backend can run here.
    """

    sm_budget: int = 8
    dma_min_bytes: int = 256 << 10
    kernel_share: float = attrs.field(default=0.0, validator=_share)
    strided: bool = True
    dma: Any = None
    kernel: Any = None
    _planner: Planner | None = attrs.field(default=None, init=False)
    _backends: list[Any] = attrs.field(factory=list, init=False)
    _pending: collections.deque[tuple[int, list[tuple[int, int]]]] = attrs.field(
        factory=collections.deque, init=False)
    _seen: list[int] = attrs.field(factory=list, init=False)  # per backend: highest completed handle
    _done: list[int] = attrs.field(factory=list, init=False)
    _next: int = attrs.field(default=0, init=False)

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
    def is_available(cls) -> bool:
        """``cuda-dma`` or ``cupy-batch`` can run here."""
        from kvkit.backends.copy.cuda_dma import CudaDMACopy
        from kvkit.backends.copy.cupy_batch import CupyBatchCopy

        return CudaDMACopy.is_available() or CupyBatchCopy.is_available()

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
        return "split" if self.kernel_share > 0 and len(plan) > 1 else "kernel"

    @override
    def submit(self, plan: TransferPlan, *, after: Any = None) -> int:
        """Validate ``plan``, then launch it on the chosen backend(s); returns its handle.

        Raises:
            PlanError: as the inner backends; nothing was launched.
        """
        if self._planner is None:
            raise PlanError("no regions registered; call register() before submit()")
        self._planner.validate(plan)
        where = self.choose(plan)
        if where == "split":
            k = max(1, min(len(plan) - 1, round(len(plan) * self.kernel_share)))
            parts = [(self.kernel, plan.src[:k], plan.dst[:k]), (self.dma, plan.src[k:], plan.dst[k:])]
        else:
            parts = [(self.dma if where == "dma" else self.kernel, plan.src, plan.dst)]
        inner = []
        for backend, src, dst in parts:
            part = plan if len(parts) == 1 else TransferPlan(src, dst, plan.direction, plan.group)
            inner.append((self._backends.index(backend), backend.submit(part, after=after)))
        handle = self._next
        self._next += 1
        self._pending.append((handle, inner))
        return handle

    def _complete(self, parts: list[tuple[int, int]]) -> bool:
        return all(h <= self._seen[i] for i, h in parts)

    @override
    def poll(self) -> list[int]:
        """Handles completed since the last call, in submission order (non-blocking)."""
        for i, b in enumerate(self._backends):
            done = b.poll()
            if done:
                self._seen[i] = max(self._seen[i], max(done))
        while self._pending and self._complete(self._pending[0][1]):
            self._done.append(self._pending.popleft()[0])
        done, self._done = self._done, []
        return done

    @override
    def wait(self, handle: int) -> None:
        """Block until ``handle`` and every earlier handle completed.

        Raises:
            PlanError: ``handle`` was never issued.
        """
        if not 0 <= handle < self._next:
            raise PlanError(f"unknown copy handle {handle!r}; issued 0..{self._next - 1}")
        while self._pending and self._pending[0][0] <= handle:
            h, parts = self._pending.popleft()
            for i, inner in parts:
                if inner > self._seen[i]:
                    self._backends[i].wait(inner)
                    self._seen[i] = inner
            self._done.append(h)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if handle bookkeeping is inconsistent."""
        order = self._done + [h for h, _ in self._pending]
        assert order == sorted(set(order)), order
        assert all(h < self._next for h in order), (order, self._next)
        for i in range(len(self._backends)):
            assert np.all(np.diff([h for _, parts in self._pending for j, h in parts if j == i]) > 0)
        for b in self._backends:
            b.check_invariants()
