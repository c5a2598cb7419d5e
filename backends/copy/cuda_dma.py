"""``CudaDMACopy``: each plan is one batched driver call, run by the GPU's copy engines.

The copy engines move the bytes, so no SM is taken from the model; the price
is host time per descriptor (the driver walks the batch on the calling thread)
and a fixed cost per copy inside the engine, which caps small pieces well
below the PCIe limit. Hence the planner's coalescing (a run of consecutive
blocks is one descriptor) and, when the regions are evenly spaced, one 2-D
copy per block spanning every region (``cuMemcpy3DBatchAsync``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from typing_extensions import override

from kvkit._lazy import lazy_module
from kvkit.backends.copy import _driver
from kvkit.backends.copy._gpu_copy import GPUCopy
from kvkit.backends.copy.planner import Strided
from kvkit.errors import BackendUnavailableError, DeviceError
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import Direction, TransferPlan
from kvkit.warn import warn

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # torch on first use: listing the backends imports none

__all__ = ["CudaDMACopy"]


@attrs.define(eq=False)
class CudaDMACopy(GPUCopy):
    """One ``cuMemcpyBatchAsync`` (or ``cuMemcpy3DBatchAsync``) per plan, on copy engines.

    Stores read their GPU source in stream order (after ``after``); loads
    let the driver read the page-locked host source in any order, since
    nothing in the stream writes it.

    Args:
        strided: issue one 2-D copy per block across all regions when the
            regions are evenly spaced on both tiers (``cuMemcpy3DBatchAsync``:
            64x fewer operations for a per-layer cache, far less host time);
            otherwise one 1-D copy per piece or run. Off by default: on an
            H200 it moved 32 KiB pieces slower than 1-D copies beside compute.
        prefer_overlap: pass the driver's hint to prefer overlapping compute.
            On by default: without it the driver ran small host-to-device
            pieces with SM kernels that slowed a concurrent GEMM 3.6x.

    Raises:
        BackendUnavailableError: no CUDA driver, or one older than 12.8.
    """

    strided: bool = False
    prefer_overlap: bool = True
    _attributes: dict[Direction, np.ndarray] = attrs.field(factory=dict, init=False)
    _strided_error: str | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        problem = _driver.driver_problem(batch=True)
        if problem is not None:
            raise BackendUnavailableError(f"cuda-dma: {problem}")

    @classmethod
    @override
    def is_available(cls) -> bool:
        """A CUDA device and a driver with batched copies (12.8+) are present."""
        return cls.unavailable_reason() is None

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this backend cannot run here (``kvkit list`` shows it), or ``None``."""
        problem = _driver.driver_problem(batch=True)  # first: without a driver, torch need not load
        if problem is None and not torch.cuda.is_available():
            return "no CUDA device"
        return problem

    @override
    def _registered(self, regions: Sequence[Region]) -> None:
        flags = _driver.FLAG_PREFER_OVERLAP if self.prefer_overlap else 0
        assert self._device is not None, "register sets the device before this hook"
        device = self._device.index or 0
        self._attributes = {}
        for direction in Direction:
            a = np.zeros(1, dtype=_driver.ATTRS_DTYPE)
            store = direction is Direction.STORE
            a["order"] = _driver.ORDER_STREAM if store else _driver.ORDER_ANY
            a["src_loc"], a["src_id"] = (_driver.LOC_DEVICE, device) if store else (_driver.LOC_HOST, 0)
            a["dst_loc"], a["dst_id"] = (_driver.LOC_HOST, 0) if store else (_driver.LOC_DEVICE, device)
            a["flags"] = flags
            self._attributes[direction] = a

    @override
    def _launch(self, plan: TransferPlan, stream: torch.cuda.Stream, regions: range, prepared: Any) -> Any:
        lib = _driver.driver()
        lib.ensure_context(self._context)
        assert self._planner is not None
        strided = (self._planner.strided(plan, regions=regions)
                   if self.strided and self._strided_error is None else None)
        if strided is not None:
            ops = self._ops(strided, plan.direction)
            try:
                lib.memcpy_3d_batch(ops, stream.cuda_stream)
                return ops
            except DeviceError as exc:  # the call enqueued nothing: fall back to 1-D copies for good
                self._strided_error = str(exc)
                warn(f"cuda-dma: 2-D batched copies refused ({exc}); using 1-D copies", RuntimeWarning)
        desc = self._planner.descriptors(plan, regions=regions)
        lib.memcpy_batch(desc.dst, desc.src, desc.size, self._attributes[plan.direction], stream.cuda_stream)
        return desc

    def _ops(self, s: Strided, direction: Direction) -> np.ndarray:
        """``CUDA_MEMCPY3D_BATCH_OP`` records for ``s``, one per copy, built column-wise."""
        a = self._attributes[direction][0]
        ops = np.zeros(len(s), dtype=_driver.BATCH_OP_DTYPE)
        for side, ptr, pitch, loc, loc_id in (("src", s.src, s.src_pitch, a["src_loc"], a["src_id"]),
                                               ("dst", s.dst, s.dst_pitch, a["dst_loc"], a["dst_id"])):
            op = ops[side]
            op["type"] = _driver.POINTER_OPERAND
            op["ptr"] = ptr
            op["row"] = pitch
            op["layer"] = s.height
            op["loc"], op["loc_id"] = loc, loc_id
        ops["width"] = s.width
        ops["height"] = s.height
        ops["depth"] = 1
        ops["order"] = a["order"]
        ops["flags"] = a["flags"]
        return ops
