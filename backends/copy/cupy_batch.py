"""``CupyBatchCopy``: one CuPy kernel launch copies a whole plan on a few SMs.

The kernel reads two tables: the registration's regions (base address on each
tier, block stride on each tier, piece bytes; uploaded once per
:meth:`~CupyBatchCopy.register`) and the plan's (source block, destination
block) pairs (16 bytes a pair, uploaded per plan). Work item ``u`` is one
chunk of one block's piece in one region; the kernel derives its source,
destination and size from the two tables, so the host never expands
``blocks x regions`` descriptors: 1024 blocks x 64 regions cost the host one
16 KiB table. Page-locked host memory is read and written directly through its
device address: no staging, no copy engine.

Two ways to move a chunk, by ``method``:

``"bulk"`` (sm_90+, the default there)
    Lane 0 of each warp streams its chunks through ``stages`` shared-memory
    buffers with the bulk asynchronous copy unit (TMA): a bulk load
    global->shared completing on an mbarrier, then a bulk store
    shared->global. Few registers and threads; ~200 KB in flight per SM.
``"vector"``
    Every thread moves 16-byte words with streaming loads and stores,
    ``unroll`` loads in flight before the first store.

Measured on an H200 (BENCHMARKS.md, "GPU copy backends"): both reach ~50 GB/s
per direction on 32 KiB pieces from 2 SMs; beside a bf16 GEMM, stores by the
vector kernel slowed it 1.3x on 2 SMs where the bulk kernel slowed it 1.04x.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from kvkit._lazy import lazy_module
from kvkit.backends.copy._driver import driver_problem
from kvkit.backends.copy._gpu_copy import GPUCopy
from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.interfaces.copy import Region
from kvkit.interfaces.types import Direction, TransferPlan
from kvkit.validate import at_least, check_int, one_of

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_module("torch", globals())  # torch on first use: listing the backends imports none

__all__ = ["CupyBatchCopy"]

# Shared by both kernels: decode work item u into (source, destination, bytes).
# regions: [nregions][5] = gpu base, cpu base, gpu stride, cpu stride, piece;
# pairs: [npairs][2] = source block, destination block. Items run region-major,
# then pair, then chunk, so neighbouring warps read neighbouring memory.
_ITEM = r"""
struct Item { unsigned long long src, dst; long long bytes; };

__device__ __forceinline__ Item item_at(const long long* __restrict__ regions, const long long* __restrict__ pairs,
                                        long long u, long long per_region, int chunks, long long chunk, int store) {
    const long long r = u / per_region;
    const long long t = u - r * per_region;
    const long long j = t / chunks;
    const long long off = (t - j * chunks) * chunk;
    const long long* reg = regions + 5 * r;
    Item it;
    it.bytes = min(chunk, reg[4] - off);  // <= 0: this piece has fewer chunks than the largest
    it.src = (unsigned long long)(reg[store ? 0 : 1] + pairs[2 * j] * reg[store ? 2 : 3] + off);
    it.dst = (unsigned long long)(reg[store ? 1 : 0] + pairs[2 * j + 1] * reg[store ? 3 : 2] + off);
    return it;
}
"""

_VECTOR = _ITEM + r"""
extern "C" __global__ void __launch_bounds__(THREADS, 1)
kvkit_batch_copy(const long long* __restrict__ regions, const int nregions, const long long* __restrict__ pairs,
                 const long long npairs, const int chunks, const long long chunk, const int store)
{
    const int lane = threadIdx.x & 31;
    const long long per_region = npairs * chunks, items = per_region * nregions;
    const long long warps = (long long)gridDim.x * (THREADS / 32);
    for (long long u = (long long)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5); u < items; u += warps) {
        const Item it = item_at(regions, pairs, u, per_region, chunks, chunk, store);
        if (it.bytes <= 0) continue;
        if (((it.src | it.dst | (unsigned long long)it.bytes) & 15ull) == 0) {
            const uint4* s = reinterpret_cast<const uint4*>(it.src);
            uint4* d = reinterpret_cast<uint4*>(it.dst);
            const long long nv = it.bytes >> 4;
            long long k = lane;
            for (; k + (UNROLL - 1) * 32 < nv; k += UNROLL * 32) {
                uint4 v[UNROLL];
#pragma unroll
                for (int q = 0; q < UNROLL; ++q) v[q] = __ldcs(s + k + q * 32);
#pragma unroll
                for (int q = 0; q < UNROLL; ++q) __stcs(d + k + q * 32, v[q]);
            }
            for (; k < nv; k += 32) __stcs(d + k, __ldcs(s + k));
        } else {  // unaligned piece: bytes, still coalesced across the warp
            const unsigned char* s = reinterpret_cast<const unsigned char*>(it.src);
            unsigned char* d = reinterpret_cast<unsigned char*>(it.dst);
            for (long long k = lane; k < it.bytes; k += 32) d[k] = s[k];
        }
    }
}
"""

# Needs every base, stride and piece 16-byte aligned and chunk <= STAGE_BYTES.
_BULK = _ITEM + r"""
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
kvkit_batch_copy(const long long* __restrict__ regions, const int nregions, const long long* __restrict__ pairs,
                 const long long npairs, const int chunks, const long long chunk, const int store)
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

    const long long per_region = npairs * chunks, items = per_region * nregions;
    const long long stride = (long long)gridDim.x * (THREADS / 32);
    long long next = (long long)blockIdx.x * (THREADS / 32) + warp;
    unsigned long long dst_of[STAGES];
    unsigned size_of[STAGES];
    unsigned phase = 0;  // bit s: parity stage s waits for next
    long long issued = 0, done = 0;
    for (;;) {
        while (issued - done < STAGES && next < items) {  // fill free stages
            const Item it = item_at(regions, pairs, next, per_region, chunks, chunk, store);
            next += stride;
            if (it.bytes <= 0) continue;
            const int s = (int)(issued % STAGES);
            dst_of[s] = it.dst;
            size_of[s] = (unsigned)it.bytes;
            const unsigned b = smem_addr(bar + s);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                         :: "r"(b), "r"((unsigned)it.bytes) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :: "r"(smem_addr(buf + (size_t)s * STAGE_BYTES)), "l"(it.src), "r"((unsigned)it.bytes),
                            "r"(b) : "memory");
            ++issued;
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
        // This stage is refilled next: its store must have read the buffer first.
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

_SMEM_LIMIT = 227 << 10  # dynamic shared memory one block may opt into on sm_90

_positive = at_least(1, label="cupy-batch: ")


def _threads(inst: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    check_int(f"cupy-batch: {attribute.name}", value, 1)
    if value % 32 or value > 1024:
        raise ConfigError(f"cupy-batch: threads must be a multiple of 32 up to 1024, got {value!r}")


def _sixteen(inst: object, attribute: attrs.Attribute, value: int) -> None:
    check_int(f"cupy-batch: {attribute.name}", value, 1)
    if value % 16:
        raise ConfigError(f"cupy-batch: {attribute.name} must be a multiple of 16, got {value!r}")


@attrs.frozen
class _Kernel:
    """One compiled kernel and its launch shape."""

    function: Any
    threads: int
    chunk: int
    smem: int


@attrs.define(eq=False)
class CupyBatchCopy(GPUCopy):
    """Copies a plan with one kernel launch on at most ``sm_budget`` SMs.

    Args:
        sm_budget: thread blocks of the persistent grid (one per SM): the
            most SMs the copy takes from the model.
        method: ``"bulk"``, ``"vector"`` or ``"auto"`` (bulk on sm_90 and
            newer, vector before). Groups whose pieces are not all 16-byte
            aligned always use ``"vector"``.
        threads: threads per block (multiple of 32, at most 1024; default
            256 for bulk, 1024 for vector).
        unroll: vector: 16-byte loads each thread has in flight.
        chunk_bytes: vector: largest piece of work one warp takes at a time.
        stages, stage_bytes: bulk: shared-memory buffers per warp and their
            size; a warp has ``stages * stage_bytes`` in flight.

    Raises:
        ConfigError: a setting out of range.
        BackendUnavailableError: CuPy or a CUDA device is missing.
    """

    sm_budget: int = attrs.field(default=2, validator=_positive)
    method: str = attrs.field(default="auto", validator=one_of(("auto", "bulk", "vector"), label="cupy-batch: "))
    threads: int | None = attrs.field(default=None, validator=_threads)
    unroll: int = attrs.field(default=8, validator=_positive)
    chunk_bytes: int = attrs.field(default=64 << 10, validator=_sixteen)
    stages: int = attrs.field(default=3, validator=_positive)
    stage_bytes: int = attrs.field(default=8 << 10, validator=_sixteen)
    _kernels: dict[str, _Kernel] = attrs.field(factory=dict, init=False)
    _tables: dict[int, tuple[torch.Tensor, int, int, bool]] = attrs.field(factory=dict, init=False)
    _cupy_streams: dict[Direction, Any] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if self.method != "vector":
            smem = self._bulk_smem(self.threads or 256)
            if smem > _SMEM_LIMIT:
                raise ConfigError(
                    f"cupy-batch: bulk needs {smem} bytes of shared memory per block (threads/32 x stages="
                    f"{self.stages!r} x stage_bytes={self.stage_bytes!r}), more than {_SMEM_LIMIT}; lower "
                    f"threads, stages or stage_bytes")
        if not self.is_available():
            raise BackendUnavailableError(f"cupy-batch: {self.unavailable_reason()}")

    def _bulk_smem(self, threads: int) -> int:
        return threads // 32 * self.stages * (self.stage_bytes + 8)

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why this backend cannot run here (``kvkit list`` shows it), or ``None``."""
        if importlib.util.find_spec("cupy") is None:
            return "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
        problem = driver_problem()  # first: without a driver, torch need not load
        if problem is None and not torch.cuda.is_available():
            return "no CUDA device"
        return problem

    @classmethod
    def is_available(cls) -> bool:
        """CuPy imports, a CUDA device and its driver are present."""
        return cls.unavailable_reason() is None

    def _registered(self, regions: Sequence[Region]) -> None:
        import cupy

        assert self._planner is not None and self._device is not None
        device = self._device.index or 0
        with cupy.cuda.Device(device):
            if not self._kernels:
                self._compile(cupy, torch.cuda.get_device_capability(self._device) >= (9, 0))
            with warnings.catch_warnings():  # newer CuPy prefers Stream.from_external; older lacks it
                warnings.simplefilter("ignore", DeprecationWarning)
                self._cupy_streams = {d: cupy.cuda.ExternalStream(s.cuda_stream, device)
                                      for d, s in self._streams.items()}
        self._tables = {}
        for group in self._planner.groups:
            table = self._planner.region_table(group)
            aligned = not (table & 15).any()
            method = "bulk" if aligned and "bulk" in self._kernels else "vector"
            chunk = self._kernels[method].chunk
            chunks = int(-(-table[:, 4].max() // chunk))
            rows = torch.from_numpy(table).to(self._device)
            self._tables[group] = (rows, len(table), chunks, method == "bulk")

    def _compile(self, cupy: Any, hopper: bool) -> None:
        """Build the kernels this configuration may launch (NVRTC runs now, not in a submit)."""
        if self.method == "bulk" and not hopper:
            raise ConfigError("cupy-batch: method 'bulk' needs an sm_90 (Hopper) or newer GPU")
        use_bulk = self.method == "bulk" or (self.method == "auto" and hopper)
        vector_threads = self.threads if self.method == "vector" and self.threads else 1024
        sources = {"vector": (_VECTOR.replace("THREADS", str(vector_threads))
                              .replace("UNROLL", str(self.unroll)), vector_threads, self.chunk_bytes, 0)}
        if use_bulk:
            threads = self.threads or 256
            sources["bulk"] = (_BULK.replace("STAGE_BYTES", str(self.stage_bytes))
                               .replace("STAGES", str(self.stages)).replace("THREADS", str(threads)),
                               threads, self.stage_bytes, self._bulk_smem(threads))
        for name, (source, threads, chunk, smem) in sources.items():
            function = cupy.RawKernel(source, "kvkit_batch_copy")
            compile_now = getattr(function, "compile", None)
            compile_now() if compile_now is not None else function.attributes
            if smem:
                function.max_dynamic_shared_size_bytes = smem
            self._kernels[name] = _Kernel(function, threads, chunk, smem)

    def _prepare(self, plan: TransferPlan, stream: torch.cuda.Stream) -> Any:
        """The plan's ``(src, dst)`` pairs on the device, shared by every stage."""
        pinned = torch.empty((len(plan), 2), dtype=torch.int64, pin_memory=True)
        pairs = pinned.numpy()
        pairs[:, 0] = plan.src
        pairs[:, 1] = plan.dst
        with torch.cuda.stream(stream):
            # Pinned source: the caching host allocator keeps it until this copy ran.
            return pinned.to(self._device, non_blocking=True)

    def _launch(self, plan: TransferPlan, stream: torch.cuda.Stream, regions: range, prepared: Any) -> Any:
        table, _, chunks, bulk = self._tables[plan.group]
        kernel = self._kernels["bulk" if bulk else "vector"]
        n, nregions = len(plan), len(regions)
        items = n * chunks * nregions
        grid = min(self.sm_budget, -(-items // (kernel.threads // 32)))
        args = (np.uint64(table[regions.start].data_ptr()), np.int32(nregions), np.uint64(prepared.data_ptr()),
                np.int64(n), np.int32(chunks), np.int64(kernel.chunk), np.int32(plan.direction is Direction.STORE))
        kernel.function((grid,), (kernel.threads,), args, stream=self._cupy_streams[plan.direction],
                        shared_mem=kernel.smem)
        return None
