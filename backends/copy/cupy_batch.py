"""``CupyBatchCopy``: one CuPy kernel launch copies a whole plan through a descriptor table.

The table holds ``(source, destination, bytes)`` triples (the planner's
coalesced descriptors, cut into chunks of at most ``chunk_bytes`` so work
spreads evenly). Each warp of a persistent grid of ``sm_budget`` blocks (one
per SM) takes table rows in turn and moves them with 16-byte streaming
accesses, ``unroll`` loads in flight per thread before the first store: a
1024-thread block keeps ~128 KiB in flight, enough to cover PCIe latency with
few SMs. Page-locked host memory is read and written directly through its
device address, so one launch does the whole plan with no staging.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from kvkit.backends.copy._driver import driver_problem
from kvkit.backends.copy._gpu_copy import GPUCopy
from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import Direction, TransferPlan

__all__ = ["CupyBatchCopy"]

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kvkit_batch_copy(const unsigned long long* __restrict__ table, const long long n)
{
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (THREADS / 32);
    for (long long i = (long long)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5); i < n; i += warps) {
        const unsigned long long src = table[3 * i], dst = table[3 * i + 1], bytes = table[3 * i + 2];
        if (((src | dst | bytes) & 15ull) == 0) {
            const uint4* s = reinterpret_cast<const uint4*>(src);
            uint4* d = reinterpret_cast<uint4*>(dst);
            const long long nv = (long long)(bytes >> 4);
            long long k = lane;
            for (; k + (UNROLL - 1) * 32 < nv; k += UNROLL * 32) {
                uint4 v[UNROLL];
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) v[u] = __ldcs(s + k + u * 32);
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) __stcs(d + k + u * 32, v[u]);
            }
            for (; k < nv; k += 32) __stcs(d + k, __ldcs(s + k));
        } else {  // unaligned piece: bytes, still coalesced across the warp
            const unsigned char* s = reinterpret_cast<const unsigned char*>(src);
            unsigned char* d = reinterpret_cast<unsigned char*>(dst);
            for (long long k = lane; k < (long long)bytes; k += 32) d[k] = s[k];
        }
    }
}
"""


def _positive(inst: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"cupy-batch: {attribute.name} must be a positive int, got {value!r}")


def _threads(inst: object, attribute: attrs.Attribute, value: int) -> None:
    _positive(inst, attribute, value)
    if value % 32 or value > 1024:
        raise ConfigError(f"cupy-batch: threads must be a multiple of 32 up to 1024, got {value!r}")


@attrs.define(eq=False)
class CupyBatchCopy(GPUCopy):
    """Copies a plan with one kernel launch on at most ``sm_budget`` SMs.

    Args:
        sm_budget: thread blocks of the persistent grid (one per SM): the
            most SMs the copy takes from the model.
        threads: threads per block (multiple of 32, at most 1024).
        unroll: 16-byte loads each thread has in flight before storing.
        chunk_bytes: largest table row; longer descriptors are cut.

    Raises:
        ConfigError: a setting out of range.
        BackendUnavailableError: CuPy or a CUDA device is missing.
    """

    sm_budget: int = attrs.field(default=8, validator=_positive)
    threads: int = attrs.field(default=1024, validator=_threads)
    unroll: int = attrs.field(default=8, validator=_positive)
    chunk_bytes: int = attrs.field(default=64 << 10, validator=_positive)
    _kernel: Any = attrs.field(default=None, init=False)
    _cupy_streams: dict[Direction, Any] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if not self.is_available():
            raise BackendUnavailableError(f"cupy-batch: {self._problem()}")
        if self.chunk_bytes % 16:
            raise ConfigError(f"cupy-batch: chunk_bytes must be a multiple of 16, got {self.chunk_bytes!r}")

    @staticmethod
    def _problem() -> str | None:
        if importlib.util.find_spec("cupy") is None:
            return "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
        if not torch.cuda.is_available():
            return "no CUDA device"
        return driver_problem()

    @classmethod
    def is_available(cls) -> bool:
        """CuPy imports, a CUDA device and its driver are present."""
        return cls._problem() is None

    def _registered(self, regions: Sequence[Region]) -> None:
        import cupy

        device = self._device.index or 0
        with cupy.cuda.Device(device):
            if self._kernel is None:
                source = _SOURCE.replace("THREADS", str(self.threads)).replace("UNROLL", str(self.unroll))
                self._kernel = cupy.RawKernel(source, "kvkit_batch_copy")
                self._kernel.compile()  # pay NVRTC now, not in the first submit
            self._cupy_streams = {d: cupy.cuda.ExternalStream(s.cuda_stream, device)
                                  for d, s in self._streams.items()}

    def _launch(self, plan: TransferPlan, stream: torch.cuda.Stream) -> Any:
        assert self._planner is not None
        desc = self._planner.descriptors(plan).split(self.chunk_bytes)
        n = len(desc)
        pinned = torch.empty((n, 3), dtype=torch.int64, pin_memory=True)
        table = pinned.numpy()
        table[:, 0] = desc.src.view(np.int64)
        table[:, 1] = desc.dst.view(np.int64)
        table[:, 2] = desc.size.view(np.int64)
        with torch.cuda.stream(stream):
            # Pinned source: the caching host allocator keeps it until this copy ran.
            rows = pinned.to(self._device, non_blocking=True)
        warps_per_block = self.threads // 32
        grid = min(self.sm_budget, -(-n // warps_per_block))
        self._kernel((grid,), (self.threads,), (np.uint64(rows.data_ptr()), np.int64(n)),
                     stream=self._cupy_streams[plan.direction])
        return rows
