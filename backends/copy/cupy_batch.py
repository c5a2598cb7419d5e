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

# Bulk asynchronous copies (the TMA unit, sm_90): lane 0 of each warp streams its
# table rows through STAGES shared-memory buffers of STAGE_BYTES: a bulk load
# global->shared completing on an mbarrier, then a bulk store shared->global.
# Rows must be 16-byte aligned (the backend checks before choosing this kernel)
# and at most STAGE_BYTES long (the table is cut to that size).
_BULK_SOURCE = r"""
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
kvkit_batch_copy(const unsigned long long* __restrict__ table, const long long n)
{
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) != 0) return;
    unsigned char* buf = smem + (size_t)warp * STAGES * STAGE_BYTES;
    unsigned long long* bar = reinterpret_cast<unsigned long long*>(
        smem + (size_t)(THREADS / 32) * STAGES * STAGE_BYTES) + warp * STAGES;
    for (int s = 0; s < STAGES; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_addr(bar + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");

    const long long stride = (long long)gridDim.x * (THREADS / 32);
    long long next = (long long)blockIdx.x * (THREADS / 32) + warp;
    unsigned long long dst_of[STAGES];
    unsigned size_of[STAGES];
    unsigned phase = 0;  // bit s: parity to wait for on stage s
    long long issued = 0, done = 0;
    for (;;) {
        while (issued - done < STAGES && next < n) {  // fill free stages
            const int s = (int)(issued % STAGES);
            const unsigned long long src = table[3 * next];
            const unsigned bytes = (unsigned)table[3 * next + 2];
            dst_of[s] = table[3 * next + 1];
            size_of[s] = bytes;
            const unsigned b = smem_addr(bar + s);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(bytes) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(smem_addr(buf + (size_t)s * STAGE_BYTES)), "l"(src), "r"(bytes), "r"(b) : "memory");
            ++issued;
            next += stride;
        }
        if (done == issued) break;
        const int s = (int)(done % STAGES);
        asm volatile("{\n\t.reg .pred p;\n\tWAIT:\n\t"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
                     "@!p bra WAIT;\n\t}"
                     :: "r"(smem_addr(bar + s)), "r"((phase >> s) & 1u) : "memory");
        phase ^= 1u << s;
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                     :: "l"(dst_of[s]), "r"(smem_addr(buf + (size_t)s * STAGE_BYTES)), "r"(size_of[s]) : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        ++done;
        // The stage is refilled next: its store must have read the buffer first.
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""


def _positive(inst: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"cupy-batch: {attribute.name} must be a positive int, got {value!r}")


def _threads(inst: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    _positive(inst, attribute, value)
    if value % 32 or value > 1024:
        raise ConfigError(f"cupy-batch: threads must be a multiple of 32 up to 1024, got {value!r}")


def _sixteen(inst: object, attribute: attrs.Attribute, value: int) -> None:
    _positive(inst, attribute, value)
    if value % 16:
        raise ConfigError(f"cupy-batch: {attribute.name} must be a multiple of 16, got {value!r}")


_SMEM_LIMIT = 227 << 10  # dynamic shared memory one block may opt into on sm_90


@attrs.define(eq=False)
class CupyBatchCopy(GPUCopy):
    """Copies a plan with one kernel launch on at most ``sm_budget`` SMs.

    Args:
        sm_budget: thread blocks of the persistent grid (one per SM): the
            most SMs the copy takes from the model.
        method: ``"vector"`` (16-byte loads and stores by every thread) or
            ``"bulk"`` (bulk asynchronous copies through shared memory, one
            thread per warp; plans with pieces not 16-byte aligned fall back
            to ``"vector"``).
        threads: threads per block (multiple of 32, at most 1024; default
            1024 for ``"vector"``, 128 for ``"bulk"``).
        unroll: ``"vector"``: 16-byte loads each thread has in flight.
        chunk_bytes: largest table row; longer descriptors are cut.
        stages, stage_bytes: ``"bulk"``: shared-memory buffers per warp and
            their size (the bytes each warp has in flight).

    Raises:
        ConfigError: a setting out of range.
        BackendUnavailableError: CuPy or a CUDA device is missing.
    """

    sm_budget: int = attrs.field(default=8, validator=_positive)
    method: str = attrs.field(default="vector")
    threads: int | None = attrs.field(default=None, validator=_threads)
    unroll: int = attrs.field(default=8, validator=_positive)
    chunk_bytes: int = attrs.field(default=64 << 10, validator=_sixteen)
    stages: int = attrs.field(default=4, validator=_positive)
    stage_bytes: int = attrs.field(default=12 << 10, validator=_sixteen)
    _kernels: dict[str, Any] = attrs.field(factory=dict, init=False)
    _cupy_streams: dict[Direction, Any] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if self.method not in ("vector", "bulk"):
            raise ConfigError(f"cupy-batch: method must be 'vector' or 'bulk', got {self.method!r}")
        if self.threads is None:
            self.threads = 1024 if self.method == "vector" else 128
        if self.method == "bulk" and self._smem_bytes > _SMEM_LIMIT:
            raise ConfigError(
                f"cupy-batch: bulk needs {self._smem_bytes} bytes of shared memory per block "
                f"(threads/32 x stages x stage_bytes), more than {_SMEM_LIMIT}; lower threads, "
                f"stages or stage_bytes")
        if not self.is_available():
            raise BackendUnavailableError(f"cupy-batch: {self._problem()}")

    @property
    def _smem_bytes(self) -> int:
        slots = (self.threads or 0) // 32 * self.stages
        return slots * (self.stage_bytes + 8)

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
            if not self._kernels:
                vector = _SOURCE.replace("THREADS", str(self.threads if self.method == "vector" else 1024))
                self._kernels["vector"] = cupy.RawKernel(vector.replace("UNROLL", str(self.unroll)),
                                                         "kvkit_batch_copy")
                if self.method == "bulk":
                    bulk = (_BULK_SOURCE.replace("STAGE_BYTES", str(self.stage_bytes))
                            .replace("STAGES", str(self.stages)).replace("THREADS", str(self.threads)))
                    self._kernels["bulk"] = cupy.RawKernel(bulk, "kvkit_batch_copy")  # CuPy targets this device
                for kernel in self._kernels.values():  # pay NVRTC now, not in the first submit
                    compile_now = getattr(kernel, "compile", None)
                    compile_now() if compile_now is not None else kernel.attributes
                if self.method == "bulk":
                    self._kernels["bulk"].max_dynamic_shared_size_bytes = self._smem_bytes
            self._cupy_streams = {d: cupy.cuda.ExternalStream(s.cuda_stream, device)
                                  for d, s in self._streams.items()}

    def _launch(self, plan: TransferPlan, stream: torch.cuda.Stream) -> Any:
        assert self._planner is not None
        desc = self._planner.descriptors(plan)
        method = self.method
        if method == "bulk" and ((desc.src | desc.dst | desc.size) & np.uint64(15)).any():
            method = "vector"
        desc = desc.split(min(self.chunk_bytes, self.stage_bytes) if method == "bulk" else self.chunk_bytes)
        n = len(desc)
        pinned = torch.empty((n, 3), dtype=torch.int64, pin_memory=True)
        table = pinned.numpy()
        table[:, 0] = desc.src.view(np.int64)
        table[:, 1] = desc.dst.view(np.int64)
        table[:, 2] = desc.size.view(np.int64)
        with torch.cuda.stream(stream):
            # Pinned source: the caching host allocator keeps it until this copy ran.
            rows = pinned.to(self._device, non_blocking=True)
        threads = self.threads if method == self.method else 1024
        grid = min(self.sm_budget, -(-n // (threads // 32)))
        args = (np.uint64(rows.data_ptr()), np.int64(n))
        stream_ = self._cupy_streams[plan.direction]
        if method == "bulk":
            self._kernels["bulk"]((grid,), (threads,), args, stream=stream_, shared_mem=self._smem_bytes)
        else:
            self._kernels["vector"]((grid,), (threads,), args, stream=stream_)
        return rows
