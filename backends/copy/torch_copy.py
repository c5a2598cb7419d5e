"""``TorchCopy``: the portable reference copy backend, built on torch indexing ops.

Each plan costs a handful of torch ops per region (a gather, a copy, a
scatter) whatever its length: index tensors are built once per plan, and a
run of consecutive ids is sliced instead of gathered. On CUDA every op runs on
one low-priority side stream; with both tiers in host memory (CI's stand-in
for a GPU, vLLM on CPU) the copy runs synchronously inside
:meth:`TorchCopy.submit`, or on one background thread with ``host_thread``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from typing_extensions import override

from kvkit._lazy import lazy_module
from kvkit.backends.copy._inflight import HandleQueue, InFlight, launch_stages
from kvkit.backends.copy.planner import Planner, stage_waits
from kvkit.errors import SpecMismatchError
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import Direction, TransferPlan
from kvkit.validate import check_bool, checked

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # torch on first use: listing the backends imports none

__all__ = ["TorchCopy"]


@functools.cache
def _words() -> tuple[torch.dtype, ...]:
    """Widest first: moving int64 words instead of bytes makes index kernels ~8x cheaper."""
    return (torch.int64, torch.int32, torch.int16, torch.uint8)


def _as_rows(t: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    """``t`` as ``[num_blocks, words]`` of ``word``, or ``None`` if misaligned for it."""
    rows = (t.unsqueeze(1) if t.dim() == 1 else t).flatten(1).view(torch.uint8)
    k = word.itemsize
    if rows.shape[1] % k or rows.stride(0) % k or rows.data_ptr() % k:
        return None
    return rows.view(word)


@attrs.frozen(eq=False)
class _Rows:
    """One region's tiers as 2-D row tensors of the same word type and width."""

    gpu: torch.Tensor
    cpu: torch.Tensor

    @classmethod
    def of(cls, region: Region) -> _Rows:
        for word in _words():
            gpu, cpu = _as_rows(region.gpu, word), _as_rows(region.cpu, word)
            if gpu is not None and cpu is not None:
                return cls(gpu, cpu)
        raise AssertionError(f"uint8 rows always fit: region {region.name!r}")


def _scatter(scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Host scatters of staged device-to-host copies: ``(destination rows, ids, staging rows)``."""
    for dst, idx, staging in scatters:
        dst.index_copy_(0, idx, staging)


@attrs.frozen(eq=False)
class _Landing:
    """A host copy on the background thread, as the event ``InFlight`` polls: done once the copy landed.

    ``query`` and ``synchronize`` raise the error the copy raised (its handle
    then stays pending: the backend is broken), as a CUDA event's do.
    """

    future: Future[float]

    def query(self) -> bool:
        if not self.future.done():
            return False
        self.future.result()
        return True

    def synchronize(self) -> None:
        self.future.result()


def _run_start(ids: np.ndarray) -> int | None:
    """First id if ``ids`` are consecutive ascending (one slice), else ``None``."""
    if len(ids) and ids[-1] - ids[0] == len(ids) - 1 and (len(ids) == 1 or bool((np.diff(ids) == 1).all())):
        return int(ids[0])
    return None


@attrs.define(eq=False)
class TorchCopy(HandleQueue, CopyBackend):
    """Copies block pieces with torch gathers and scatters; works on CPU tensors too.

    Args:
        host_thread: with both tiers in host memory, copies run on one
            background thread, so :meth:`submit` returns at once and the
            caller (an engine's worker) runs on while the bytes move;
            :meth:`submit_stages` still returns once its copy landed (the
            :class:`~kvkit.interfaces.capabilities.LayeredCopy` contract:
            host stages answer no events). A submit whose thread cannot start
            raises, and its copy never runs. ``False`` (default): host copies
            run inside the call. Copies on CUDA use the side stream either way.

    Invariants:
        * Handles are issued 0, 1, 2...; each is reported by :meth:`poll`
          exactly once, in order (one stream, or one thread, runs every copy, FIFO).
        * On CUDA nothing runs on the legacy default stream; a copy reads its
          source only after ``after`` (a ``torch.cuda.Event``) completed.
        * A rejected plan writes nothing; a ``submit`` that raises leaves nothing running.
        * Every copy is timed (:class:`~kvkit.interfaces.capabilities.TimedCopy`):
          ``copy_seconds`` answers its own time once :meth:`poll` reported it,
          until the next poll (on CUDA, by timing events around its work on
          the stream: waits on ``after`` are not counted).
    """

    host_thread: bool = attrs.field(default=False, converter=checked(check_bool, label="TorchCopy."))  # type: ignore[misc]

    _rows: dict[int, list[_Rows]] = attrs.field(factory=dict, init=False)
    _planner: Planner = attrs.field(factory=Planner, init=False)  # validates plans only
    _stream: torch.cuda.Stream | None = attrs.field(default=None, init=False)
    _inflight: InFlight = attrs.field(factory=InFlight, init=False)
    _scratch: torch.Tensor = attrs.field(factory=lambda: torch.empty(0, dtype=torch.uint8), init=False)
    _thread: ThreadPoolExecutor | None = attrs.field(default=None, init=False)  # host_thread's, once a copy came

    @classmethod
    @override
    def is_available(cls) -> bool:
        """Always: torch runs everywhere kvkit does."""
        return True

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream copies run on (``None`` when both tiers are host memory)."""
        return self._stream

    @override
    def register(self, regions: Sequence[Region]) -> None:
        """Register the regions plans copy; replaces any earlier registration.

        Raises:
            SpecMismatchError: duplicate names, GPU-tier tensors on several
                devices, or a CPU-tier tensor not in host memory.
        """
        planner = Planner.of(regions)
        devices = {r.gpu.device for r in regions}
        if len(devices) > 1:
            raise SpecMismatchError(f"GPU-tier tensors span several devices: {sorted(map(str, devices))}")
        rows: dict[int, list[_Rows]] = {}
        for r in regions:
            rows.setdefault(r.group, []).append(_Rows.of(r))
        device = devices.pop() if devices else torch.device("cpu")
        if device.type == "cuda":
            # Copies yield to the model's kernels: least priority of the device's range.
            # torch's stub omits that priority_range is a staticmethod
            least = torch.cuda.Stream.priority_range()[0]  # type: ignore[call-arg]
            self._stream = torch.cuda.Stream(device, priority=least)
        else:
            self._stream = None
        self._rows, self._planner = rows, planner

    @override
    def submit(self, plan: TransferPlan, *, after: Any = None) -> int:
        """Validate ``plan`` and start copying it; returns its handle.

        Raises:
            PlanError: unknown group, ids out of range or repeated destination
                ids; nothing was launched or written.
        """
        self._planner.validate(plan)
        return self._start(plan, [range(len(self._planner.region_names(plan.group)))], [after], staged=False)[0]

    def submit_stages(self, plan: TransferPlan, stages: Sequence[range], *,
                      after: Any = None) -> tuple[int, list[tuple[Any, ...]]]:
        """:class:`~kvkit.interfaces.capabilities.LayeredCopy`: ``plan`` stage by stage, one event per stage.

        With both tiers in host memory every stage has landed on return (no events).

        Raises:
            PlanError: as :meth:`submit`, or stages that do not partition the
                group's regions, or an ``after`` list of another length; nothing was launched.
        """
        self._planner.validate(plan)
        stages = self._planner.stages(plan, stages)
        return self._start(plan, stages, stage_waits(after, len(stages)), staged=True)

    def _start(self, plan: TransferPlan, stages: list[range], waits: list[Any], *,
               staged: bool) -> tuple[int, list[tuple[Any, ...]]]:
        if self._stream is None:
            landed = [() for _ in stages]
            if not self.host_thread:
                return self._inflight.issue(clock=self._copy_host(plan, stages)), landed
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvkit-torch-copy")
            try:
                future = self._thread.submit(self._copy_host, plan, stages)
            except RuntimeError:  # its thread cannot start, and the pool queued the copy first: it must never run
                self._thread.shutdown(wait=False, cancel_futures=True)
                self._thread = None
                raise
            if staged:
                future.result()  # host stages answer no events: landed on return
            return self._inflight.issue(_Landing(future), clock=future), landed
        # (destination rows, ids, pinned staging rows): scattered on the host
        # once the event shows the device-to-host copy landed.
        scatters: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        keep_alive: list[torch.Tensor] = []  # host buffers the device reads asynchronously
        with torch.cuda.stream(self._stream):
            try:
                index = self._index(plan)  # on the copy stream, which reads it
                events, clock = launch_stages(
                    self._stream, stages, waits, lambda stage: self._launch(plan, stage, index, scatters, keep_alive))
            except Exception:
                self._stream.synchronize()  # a raising submit leaves nothing running (some regions were queued)
                raise
        return self._inflight.issue(events[-1][0], keep_alive, functools.partial(_scatter, scatters), clock), events

    def _copy_host(self, plan: TransferPlan, stages: list[range]) -> float:
        """Copy ``plan`` between host tiers, stage after stage, on the calling thread; its own seconds."""
        started = time.perf_counter()
        index = self._index(plan)  # built once per plan, however many stages
        for stage in stages:
            self._launch(plan, stage, index, [], [])
        return time.perf_counter() - started

    def _index(self, plan: TransferPlan) -> tuple[int | None, int | None, torch.Tensor | None, torch.Tensor | None]:
        """Where the plan's source and destination blocks are: the first of a run, else an index on their device."""
        rows = self._rows[plan.group]
        if not plan or not rows:
            return None, None, None, None
        store = plan.direction is Direction.STORE
        src_dev = (rows[0].gpu if store else rows[0].cpu).device
        dst_dev = (rows[0].cpu if store else rows[0].gpu).device
        src_run, dst_run = _run_start(plan.src), _run_start(plan.dst)
        src_idx = None if src_run is not None else torch.tensor(plan.src).to(src_dev, non_blocking=True)
        dst_idx = None if dst_run is not None else torch.tensor(plan.dst).to(dst_dev, non_blocking=True)
        return src_run, dst_run, src_idx, dst_idx

    def _launch(self, plan: TransferPlan, regions: range, index: tuple, scatters: list, keep_alive: list) -> None:
        """Issue the copy of every region in ``regions`` of the plan's group on the current stream (host work now)."""
        n = len(plan)
        rows = self._rows[plan.group][regions.start:regions.stop]
        if n == 0:
            return
        store = plan.direction is Direction.STORE
        src_run, dst_run, src_idx, dst_idx = index
        for r in rows:
            src, dst = (r.gpu, r.cpu) if store else (r.cpu, r.gpu)
            dst_part = None if dst_run is None else dst[dst_run:dst_run + n]
            # 1. The source rows: a slice when consecutive, else one gather.
            if src_run is not None:
                x = src[src_run:src_run + n]
            elif dst_part is not None and src.device == dst.device:
                torch.index_select(src, 0, src_idx, out=dst_part)  # gathered straight into place
                continue
            elif src.device.type == "cpu":
                pinned = dst.device.type == "cuda"
                x = self._host_rows(n, src, pinned=pinned)
                torch.index_select(src, 0, src_idx, out=x)
                if pinned:
                    keep_alive.append(x)
            else:
                x = src.index_select(0, src_idx)
            # 2. Into place: a slice when consecutive, else one scatter.
            if dst_part is not None:
                dst_part.copy_(x, non_blocking=True)
            elif x.device == dst.device:
                dst.index_copy_(0, dst_idx, x)
            elif dst.device.type == "cpu":
                # Device-to-host into pinned staging; the host scatter waits for the event.
                staging = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                staging.copy_(x, non_blocking=True)
                scatters.append((dst, dst_idx, staging))
            else:
                dst.index_copy_(0, dst_idx, x.to(dst.device, non_blocking=True))

    def _host_rows(self, n: int, like: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        """``[n, like.shape[1]]`` host rows to gather into.

        Pinned (torch's caching host allocator) when an H2D copy reads them
        asynchronously; otherwise a reused scratch buffer, consumed before the
        next call (fresh large allocations cost more in page faults than the copy).
        """
        shape, nbytes = (n, like.shape[1]), n * like.shape[1] * like.element_size()
        if pinned:
            return torch.empty(shape, dtype=like.dtype, pin_memory=True)
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(like.dtype).view(shape)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if handle bookkeeping is inconsistent."""
        self._inflight.check_invariants()
        assert self._stream is not None or self.host_thread or not len(self._inflight), (
            "host-only copies are synchronous without host_thread")
