"""``TransferEngine``: the worker side of offloading (tensors, streams, the CPU mirror).

It owns the CPU mirror of the engine's KV cache, hands the copy backend the
regions pairing both tiers, orders every copy after the compute already queued,
and turns backend handles into :class:`~kvkit.interfaces.TransferResult` s for
the scheduler side.
"""

from __future__ import annotations

import ctypes
import os
import time
import warnings
import weakref
from collections.abc import Callable, Sequence

import attrs
import torch

from kvkit.errors import ConfigError, PlanError, UnknownBlockError
from kvkit.interfaces.capabilities import SelfChecking
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import KVCacheSpec, Tier, TransferPlan, TransferResult
from kvkit.validate import check_int
from kvkit.worker.layouts import allocate_kv, check_layouts, kv_nbytes, kv_views, regions_for, validate_kv

__all__ = ["TransferEngine"]

_REGISTER_CHUNK = 64 << 30
"""cudaHostRegister fails on single ranges above 64 GiB on some systems."""


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed host registration.

    Otherwise torch's next kernel-launch check reports it as its own failure.
    Best effort: only touches a runtime library torch already loaded.
    """
    for name in ("libcudart.so.13", "libcudart.so.12"):
        try:
            lib = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
        except OSError:
            continue
        lib.cudaGetLastError()
        return


def _register_host(buffer: torch.Tensor) -> list[int]:
    """Page-lock ``buffer`` in place with cudaHostRegister; returns the registered chunk pointers.

    Returns ``[]`` (after a warning, with nothing left registered) if the
    driver refuses; copies then still work from pageable memory, slower.
    """
    cudart = torch.cuda.cudart()
    base, size = buffer.data_ptr(), buffer.numel()
    chunks: list[int] = []
    for offset in range(0, size, _REGISTER_CHUNK):
        length = min(_REGISTER_CHUNK, size - offset)
        err = int(cudart.cudaHostRegister(base + offset, length, 0))
        if err != 0:
            _clear_cuda_error()
            _unregister_host(chunks)
            warnings.warn(
                f"cudaHostRegister of the {size}-byte CPU KV mirror failed (cudaError {err} at "
                f"offset {offset}); falling back to pageable memory: copies will be several "
                f"times slower and synchronous", RuntimeWarning, stacklevel=3)
            return []
        chunks.append(base + offset)
    return chunks


def _unregister_host(chunks: list[int]) -> None:
    if not chunks:  # nothing pinned: never touch CUDA (CPU-only runs)
        return
    cudart = torch.cuda.cudart()
    for ptr in chunks:
        cudart.cudaHostUnregister(ptr)


@attrs.define(eq=False)
class _InFlight:
    transfer_id: int
    started: float
    num_bytes: int


@attrs.define(eq=False)
class TransferEngine:
    """Runs a worker's transfers: registers its KV cache, keeps the CPU mirror, reports results.

    Args:
        spec: the cache shape (one source of truth with the scheduler side).
        copy: the copy backend that moves the bytes (fixed; if it is
            :class:`~kvkit.interfaces.capabilities.SelfChecking`, :meth:`check_invariants`
            checks it too).
        num_cpu_blocks: blocks in the CPU mirror (exactly; the scheduler's CPU pool size).
        worker: this worker's rank, stamped on every result.

    Invariants:
        * The mirror holds exactly ``num_cpu_blocks`` blocks: one host buffer
          of ``num_cpu_blocks * spec.bytes_per_block`` bytes, page-locked in
          place on CUDA (never rounded up like ``pin_memory=True``).
        * Every copy is ordered after the compute queued on the current stream
          when it was submitted.
        * Every submitted transfer id is reported by :meth:`poll` (or
          :meth:`drain`) exactly once; a failed copy is ``ok=False``, never an
          exception from :meth:`poll`.
    """

    spec: KVCacheSpec
    copy: CopyBackend = attrs.field(on_setattr=attrs.setters.frozen)
    num_cpu_blocks: int = attrs.field(kw_only=True)
    worker: int = attrs.field(default=0, kw_only=True)
    _layout: str | None = attrs.field(default=None, init=False)
    _cpu_layout: str | None = attrs.field(default=None, init=False)
    _gpu_kv: list[torch.Tensor] = attrs.field(factory=list, init=False)
    _cpu_kv: list[torch.Tensor] = attrs.field(factory=list, init=False)
    _mirror: torch.Tensor | None = attrs.field(default=None, init=False)
    _pinned_chunks: list[int] = attrs.field(factory=list, init=False)
    # Unpins the mirror even if close() is never called (runs before the buffer is freed).
    _unpin: weakref.finalize | None = attrs.field(default=None, init=False)
    _regions: list[Region] = attrs.field(factory=list, init=False)
    _group_block_bytes: dict[int, int] = attrs.field(factory=dict, init=False)
    _in_flight: dict[int, _InFlight] = attrs.field(factory=dict, init=False)  # by backend handle
    _ids_in_flight: set[int] = attrs.field(factory=set, init=False)
    _failed: list[TransferResult] = attrs.field(factory=list, init=False)
    # The backend's own check, or None: decided once, as the backend is fixed.
    _check_copy: Callable[[], None] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.copy, CopyBackend):
            raise ConfigError(f"copy must implement CopyBackend, got {type(self.copy).__name__}")
        if isinstance(self.copy, SelfChecking):
            self._check_copy = self.copy.check_invariants
        check_int("num_cpu_blocks", self.num_cpu_blocks, 1)

    # -- registration -----------------------------------------------------------------

    def register_kv(self, tensors: Sequence[torch.Tensor], layout: str, *,
                    cpu_layout: str | None = None) -> None:
        """Adopt the engine's KV ``tensors`` in ``layout``, build the CPU mirror, register regions.

        The mirror is laid out in ``cpu_layout`` (default: ``layout``); see
        :func:`kvkit.worker.layouts.regions_for` for which layouts pair.

        Raises:
            ConfigError: KV already registered, an unknown layout, or layouts
                that do not pair (checked before the mirror is allocated).
            SpecMismatchError: the tensors disagree with ``spec`` (see ``validate_kv``).
        """
        if self._layout is not None:
            raise ConfigError(f"KV cache already registered (layout {self._layout!r}); close() first")
        cpu_layout = layout if cpu_layout is None else cpu_layout
        check_layouts(self.spec, layout, cpu_layout)
        tensors = list(tensors)
        validate_kv(self.spec, layout, tensors)
        mirror = torch.empty(kv_nbytes(self.spec, cpu_layout, self.num_cpu_blocks), dtype=torch.uint8)
        cpu_kv = kv_views(self.spec, cpu_layout, self.num_cpu_blocks, mirror)
        regions = regions_for(self.spec, layout, tensors, cpu_kv, cpu_layout=cpu_layout)
        pinned = _register_host(mirror) if tensors[0].device.type == "cuda" else []
        try:
            self.copy.register(regions)
        except BaseException:
            _unregister_host(pinned)
            raise
        self._layout, self._cpu_layout, self._gpu_kv, self._cpu_kv = layout, cpu_layout, tensors, cpu_kv
        self._mirror, self._pinned_chunks, self._regions = mirror, pinned, regions
        if pinned:
            self._unpin = weakref.finalize(self, _unregister_host, pinned)
            self._unpin.atexit = False  # the process exit releases it; CUDA may be gone by then
        self._group_block_bytes = {}
        for r in regions:
            self._group_block_bytes[r.group] = self._group_block_bytes.get(r.group, 0) + r.piece_bytes

    def allocate_kv(self, num_gpu_blocks: int, layout: str, device: torch.device | str = "cpu", *,
                    cpu_layout: str | None = None) -> list[torch.Tensor]:
        """Allocate a GPU-tier cache (uninitialised) on ``device`` and register it (simulator use).

        ``cpu_layout`` as in :meth:`register_kv`.
        """
        check_layouts(self.spec, layout, cpu_layout)  # before allocating the GPU tier
        tensors = allocate_kv(self.spec, layout, num_gpu_blocks, device)
        self.register_kv(tensors, layout, cpu_layout=cpu_layout)
        return tensors

    @property
    def layout(self) -> str | None:
        """The registered GPU tier's layout, or ``None`` before :meth:`register_kv`."""
        return self._layout

    @property
    def cpu_layout(self) -> str | None:
        """The CPU mirror's layout (``layout`` unless registered otherwise), or ``None`` before registration."""
        return self._cpu_layout

    @property
    def gpu_kv(self) -> list[torch.Tensor]:
        """The registered GPU-tier tensors."""
        return list(self._gpu_kv)

    @property
    def cpu_kv(self) -> list[torch.Tensor]:
        """The CPU mirror's tensors: views into one host buffer, in :attr:`cpu_layout`."""
        return list(self._cpu_kv)

    @property
    def regions(self) -> list[Region]:
        """The regions registered with the copy backend."""
        return list(self._regions)

    @property
    def mirror_nbytes(self) -> int:
        """Bytes of the CPU mirror's host buffer (0 before registration)."""
        return 0 if self._mirror is None else self._mirror.numel()

    @property
    def mirror_pinned(self) -> bool:
        """Whether the mirror is page-locked (cudaHostRegister succeeded)."""
        return bool(self._pinned_chunks)

    # -- transfers --------------------------------------------------------------------

    def submit(self, transfer_id: int, plan: TransferPlan) -> None:
        """Start ``plan`` as transfer ``transfer_id``, ordered after the compute queued so far.

        A copy failure is reported later as ``TransferResult(ok=False)``.

        Raises:
            ConfigError: no KV cache registered yet.
            PlanError: ``transfer_id`` is already in flight, or the backend
                rejected the plan (nothing was launched).
        """
        if self._layout is None:
            raise ConfigError("no KV cache registered: call register_kv() or allocate_kv() first")
        if transfer_id in self._ids_in_flight:
            raise PlanError(f"transfer id {transfer_id!r} is already in flight")
        after = None
        if self._gpu_kv[0].device.type == "cuda":
            # A store must not read blocks the queued kernels are still writing;
            # a load must not overwrite blocks queued kernels still read. One
            # event on the compute stream covers both.
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self._gpu_kv[0].device))
        started = time.perf_counter()
        try:
            handle = self.copy.submit(plan, after=after)
        except PlanError:
            raise
        except Exception as exc:  # a failed copy is a result, not a crash of the step loop
            warnings.warn(f"transfer {transfer_id} failed to launch: {exc!r}", RuntimeWarning, stacklevel=2)
            self._failed.append(TransferResult(transfer_id, self.worker, ok=False))
            return
        num_bytes = len(plan) * self._group_block_bytes.get(plan.group, 0)
        self._in_flight[handle] = _InFlight(transfer_id, started, num_bytes)
        self._ids_in_flight.add(transfer_id)

    def poll(self) -> list[TransferResult]:
        """Results of transfers that completed since the last call (non-blocking).

        ``seconds`` runs from :meth:`submit` to the poll that saw the copy
        done, so it includes queueing behind earlier copies and poll latency.
        """
        try:
            handles = self.copy.poll()
        except Exception as exc:
            return self._fail_all(exc)
        return self._results(handles)

    def drain(self) -> list[TransferResult]:
        """Wait for every transfer in flight; return every result not yet reported."""
        if self._in_flight:
            try:
                self.copy.wait(next(reversed(self._in_flight)))  # the last submitted
            except Exception as exc:
                return self._fail_all(exc)
        return self.poll()

    def _results(self, handles: list[int]) -> list[TransferResult]:
        now = time.perf_counter()
        results, self._failed = self._failed, []
        for handle in handles:
            job = self._in_flight.pop(handle, None)
            if job is not None:  # handles of transfers already failed by _fail_all are dropped
                self._ids_in_flight.discard(job.transfer_id)
                results.append(TransferResult(job.transfer_id, self.worker, ok=True,
                                              seconds=now - job.started, num_bytes=job.num_bytes))
        return results

    def _fail_all(self, exc: Exception) -> list[TransferResult]:
        warnings.warn(f"copy backend failed; failing {len(self._in_flight)} transfer(s) in flight: "
                      f"{exc!r}", RuntimeWarning, stacklevel=3)
        results, self._failed = self._failed, []
        results += [TransferResult(job.transfer_id, self.worker, ok=False) for job in self._in_flight.values()]
        self._in_flight.clear()
        self._ids_in_flight.clear()
        return results

    @property
    def num_in_flight(self) -> int:
        """Transfers submitted and not yet reported."""
        return len(self._in_flight) + len(self._failed)

    # -- inspection -------------------------------------------------------------------

    def block_pieces(self, tier: Tier, block: int, group: int | None = None) -> list[torch.Tensor]:
        """Views of ``block``'s piece in every region (of ``group``, if given), in region order.

        ``tier`` is a :class:`~kvkit.interfaces.Tier` or its value (``"gpu"``, ``"cpu"``).

        Raises:
            ConfigError: no KV registered, or ``tier`` not ``"gpu"``/``"cpu"``.
            UnknownBlockError: ``block`` is out of range for that tier.
        """
        if self._layout is None:
            raise ConfigError("no KV cache registered")
        if tier not in (Tier.GPU, Tier.CPU):
            raise ConfigError(f"tier must be 'gpu' or 'cpu', got {tier!r}")
        regions = [r for r in self._regions if group is None or r.group == group]
        tensors = [r.gpu if tier == Tier.GPU else r.cpu for r in regions]
        limit = min(t.shape[0] for t in tensors)
        if not 0 <= block < limit:
            raise UnknownBlockError(f"{tier} block {block!r} out of range [0, {limit})")
        return [t[block] for t in tensors]

    def read_block(self, tier: Tier, block: int, group: int | None = None) -> bytes:
        """The bytes of ``block`` on ``tier``: every region's piece, concatenated in region order."""
        pieces = self.block_pieces(tier, block, group)
        return b"".join(p.contiguous().view(torch.uint8).cpu().numpy().tobytes() for p in pieces)

    # -- lifecycle --------------------------------------------------------------------

    def close(self) -> list[TransferResult]:
        """Drain, unregister the mirror and forget the KV cache; returns the last results.

        Idempotent; the engine can register a cache again afterwards.
        """
        results = self.drain() if self._layout is not None else []
        if self._unpin is not None:
            self._unpin()  # after the drain: no copy touches the mirror any more
        self._layout, self._cpu_layout, self._gpu_kv, self._cpu_kv, self._regions = None, None, [], [], []
        self._mirror, self._pinned_chunks, self._unpin, self._group_block_bytes = None, [], None, {}
        return results

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the mirror or the in-flight bookkeeping is inconsistent."""
        if self._layout is None:
            assert not self._in_flight and self._mirror is None and not self._pinned_chunks
            assert self._cpu_layout is None
            return
        assert self._cpu_layout is not None
        assert self._mirror is not None
        assert self._mirror.numel() == self.num_cpu_blocks * self.spec.bytes_per_block
        base = self._mirror.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in self._cpu_kv), "mirror views escaped"
        assert all(job.num_bytes >= 0 for job in self._in_flight.values())
        assert self._ids_in_flight == {job.transfer_id for job in self._in_flight.values()}
        if self._check_copy is not None:
            self._check_copy()
