"""``StagedCopy``: whole CPU blocks over PCIe, gathered and scattered on the GPU.

A per-layer GPU cache cuts each block into many small pieces (64 of 32 KiB for
Llama-3-8B), and copying those pieces one by one caps both directions at once
at 65 GB/s on an H200. When the CPU tier keeps a block's pieces back to back
(``cpu_layout="cross-layer"``), this backend instead moves a plan in chunks of
``chunk_blocks`` blocks through GPU staging buffers:

* a store gathers the chunk's pieces into a staging slot laid out like CPU
  blocks (one ``cupy-batch`` kernel launch on ``sm_budget`` SMs), then the
  copy engines move whole blocks to the CPU tier (one ``cuda-dma`` call);
* a load runs the other way: whole blocks into a slot, then a scatter kernel.

Each direction of each KV group has ``slots`` slots; a slot is reused only
after the copy that drains it completed (CUDA events, no host waits), so the
gather of one chunk overlaps the DMA of the previous one. Measured on an H200
(BENCHMARKS.md): 83-93 GB/s both directions at once where per-piece copies of
the same plans reach 65.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from typing_extensions import override

from kvkit._lazy import lazy_module
from kvkit.backends.copy._inflight import HandleQueue, InFlight
from kvkit.backends.copy.cuda_dma import CudaDMACopy
from kvkit.backends.copy.cupy_batch import CupyBatchCopy
from kvkit.backends.copy.planner import Planner, registered
from kvkit.errors import BackendUnavailableError, SpecMismatchError
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import Direction, Tier, TransferPlan
from kvkit.validate import at_least

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # torch on first use: listing the backends imports none

__all__ = ["StagedCopy"]


_positive = at_least(1, label="staged: ")


class _StagingKernel(CupyBatchCopy):
    """``cupy-batch`` whose "CPU tier" is a GPU staging buffer (gather and scatter on the device)."""

    _cpu_tier_device = "cuda"


@attrs.define(eq=False)
class _Ring:
    """The staging slots of one group and direction, and the events that free them."""

    free: list[Any]  # per slot: event after which the slot may be overwritten, or None
    next: int = 0

    def take(self) -> tuple[int, Any]:
        """The next slot in turn and the event to wait for before writing it."""
        slot, self.next = self.next, (self.next + 1) % len(self.free)
        return slot, self.free[slot]


def _block_span(group: Sequence[Region]) -> tuple[int, int, int]:
    """``(base address, block bytes, blocks)`` of a CPU tier whose pieces tile each block.

    Raises:
        SpecMismatchError: the group's CPU pieces are not one block's bytes back
            to back at a common stride in one allocation.
    """
    regions = sorted(group, key=lambda r: r.cpu.data_ptr())
    base = regions[0].cpu.data_ptr()
    stride = regions[0].stride_bytes(Tier.CPU)
    offset = 0
    for r in regions:
        if (r.cpu.data_ptr() - base != offset or r.stride_bytes(Tier.CPU) != stride
                or r.cpu.untyped_storage().data_ptr() != regions[0].cpu.untyped_storage().data_ptr()):
            break
        offset += r.piece_bytes
    else:
        if offset == stride:
            return base, stride, min(r.cpu.shape[0] for r in regions)
    raise SpecMismatchError(
        f"staged: the CPU tier of regions {[r.name for r in group]!r} does not keep each block's "
        f"pieces back to back in one buffer; allocate it with cpu_layout='cross-layer'")


def _bytes_at(like: torch.Tensor, address: int, rows: int, row_bytes: int) -> torch.Tensor:
    """A ``[rows, row_bytes]`` uint8 view of ``like``'s storage starting at ``address``."""
    storage = like.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=like.device).set_(
        storage, address - storage.data_ptr(), (rows, row_bytes), (row_bytes, 1))


@attrs.define(eq=False)
class StagedCopy(HandleQueue, CopyBackend):
    """Copies whole CPU blocks with the copy engines, staging them on the GPU in chunks.

    Args:
        chunk_blocks: blocks per staging slot (a slot holds that many CPU blocks).
        slots: staging slots per direction and KV group; GPU memory taken is
            ``2 * slots * chunk_blocks`` CPU blocks per group.
        sm_budget: SMs each gather or scatter kernel may take.

    Invariants:
        * A store reads its GPU source only after ``after``; a slot is written
          only after the copy that last read it completed; slots outlive every
          copy that uses them, even across a new :meth:`register`.
        * A plan is validated in full before anything is launched; handles are
          reported by :meth:`poll` exactly once, in submission order; a
          ``submit`` that raises leaves nothing running.

    Raises:
        ConfigError: a setting out of range.
        BackendUnavailableError: CuPy, a CUDA device or a driver with batched
            copies is missing.
    """

    chunk_blocks: int = attrs.field(default=32, validator=_positive)
    slots: int = attrs.field(default=2, validator=_positive)
    sm_budget: int = attrs.field(default=4, validator=_positive)
    _kernel: Any = attrs.field(default=None, init=False)
    _dma: Any = attrs.field(default=None, init=False)
    _planner: Planner | None = attrs.field(default=None, init=False)
    _rings: dict[tuple[int, Direction], _Ring] = attrs.field(factory=dict, init=False)
    _staging: list[torch.Tensor] = attrs.field(factory=list, init=False)
    _device: torch.device | None = attrs.field(default=None, init=False)
    _inflight: InFlight = attrs.field(factory=InFlight, init=False)

    def __attrs_post_init__(self) -> None:
        if not self.is_available():
            raise BackendUnavailableError(f"staged: {self.unavailable_reason()}")
        self._kernel = _StagingKernel(sm_budget=self.sm_budget)
        self._dma = CudaDMACopy()

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this backend cannot run here (``kvkit list`` shows it), or ``None``."""
        return CupyBatchCopy.unavailable_reason() or CudaDMACopy.unavailable_reason()

    @override
    @classmethod
    def is_available(cls) -> bool:
        """CuPy, a CUDA device and a driver with batched copies (12.8+) are present."""
        return cls.unavailable_reason() is None

    @override
    def register(self, regions: Sequence[Region]) -> None:
        """Register ``regions``; allocate the staging slots of every group.

        Raises:
            SpecMismatchError: as the other GPU backends, or a group whose CPU
                tier does not keep each block's pieces back to back.
        """
        planner = Planner.of(regions)
        by_group: dict[int, list[Region]] = {}
        for r in regions:
            by_group.setdefault(r.group, []).append(r)
        staging_regions, block_regions, rings = [], [], {}
        for group, rs in by_group.items():
            base, block_bytes, cpu_blocks = _block_span(rs)
            cpu_blocks_view = _bytes_at(rs[0].cpu, base, cpu_blocks, block_bytes)
            for d in Direction:
                inner = 2 * group + (d is Direction.LOAD)
                stage = torch.empty((self.slots * self.chunk_blocks, block_bytes), dtype=torch.uint8,
                                    device=rs[0].gpu.device)
                for r in rs:
                    offset = r.cpu.data_ptr() - base
                    piece = stage[:, offset:offset + r.piece_bytes].view(r.gpu.dtype)
                    piece = piece.unflatten(1, r.gpu.shape[1:])
                    staging_regions.append(Region(f"{r.name}.{d.value}", r.gpu, piece, group=inner))
                block_regions.append(Region(f"group{group}.{d.value}", stage, cpu_blocks_view, group=inner))
                rings[group, d] = _Ring([None] * self.slots)
        self._kernel.register(staging_regions)
        self._dma.register(block_regions)
        # Copies still in flight keep their registration's slots alive (see submit).
        self._planner, self._rings, self._staging = planner, rings, [r.gpu for r in block_regions]
        self._device = regions[0].gpu.device

    @override
    def submit(self, plan: TransferPlan, *, after: Any = None) -> int:
        """Validate ``plan`` (a ``PlanError`` launches nothing), then enqueue its chunks.

        A store gathers each chunk into a slot, then moves it by DMA; a load the reverse.
        """
        registered(self._planner, plan)
        if not len(plan):
            return self._inflight.issue()
        store = plan.direction is Direction.STORE
        inner = 2 * plan.group + (not store)
        ring = self._rings[plan.group, plan.direction]
        first, second = (self._kernel, self._dma) if store else (self._dma, self._kernel)
        with torch.cuda.device(self._device):
            if after is not None:
                first.stream(plan.direction).wait_event(after)
            try:
                done = self._chunks(plan, ring, inner, first, second)
            except Exception:
                for backend in (first, second):  # a raising submit leaves nothing running
                    backend.stream(plan.direction).synchronize()
                raise
        return self._inflight.issue(done, keep_alive=self._staging)

    def _chunks(self, plan: TransferPlan, ring: _Ring, inner: int, first: Any, second: Any) -> Any:
        """Enqueue ``plan`` chunk by chunk through ``ring``'s slots; returns the event after the last chunk."""
        done = None
        for start in range(0, len(plan), self.chunk_blocks):
            src = plan.src[start:start + self.chunk_blocks]
            dst = plan.dst[start:start + self.chunk_blocks]
            slot, free = ring.take()
            staged = np.arange(slot * self.chunk_blocks, slot * self.chunk_blocks + len(src))
            if free is not None:
                first.stream(plan.direction).wait_event(free)
            first.submit(TransferPlan(src, staged, plan.direction, inner))
            ready = torch.cuda.Event()
            ready.record(first.stream(plan.direction))
            second.submit(TransferPlan(staged, dst, plan.direction, inner), after=ready)
            done = torch.cuda.Event()
            done.record(second.stream(plan.direction))
            ring.free[slot] = done
        return done

    @override
    def poll(self) -> list[int]:
        """Handles completed since the last call, in submission order (non-blocking)."""
        self._release()
        return super().poll()

    @override
    def wait(self, handle: int) -> None:
        """Block until ``handle`` and every earlier handle completed.

        Raises:
            PlanError: ``handle`` was never issued.
        """
        super().wait(handle)
        self._release()

    def _release(self) -> None:
        """Let the inner copies drop what they kept alive for the device (their handles are not ours)."""
        self._kernel.poll()
        self._dma.poll()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if handle bookkeeping is inconsistent."""
        self._inflight.check_invariants()
        self._kernel.check_invariants()
        self._dma.check_invariants()
