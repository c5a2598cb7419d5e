"""``TransferEngine``: the worker side of offloading (tensors, streams, the CPU mirror).

It owns the CPU mirror of the engine's KV cache, hands the copy backend the
regions pairing both tiers, orders every copy after the compute already queued,
and turns backend handles into :class:`~kvkit.interfaces.TransferResult` s for
the scheduler side.
"""

from __future__ import annotations

import ctypes
import os
import re
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvkit.errors import (
    ConfigError,
    InsufficientMemoryError,
    PlanError,
    TransferTimeoutError,
    UnknownBlockError,
)
from kvkit.interfaces.capabilities import LayeredCopy, SelfChecking, TimedCopy
from kvkit.interfaces.copy import CopyBackend, Region
from kvkit.interfaces.types import Direction, KVCacheSpec, Tier, TransferPlan, TransferResult
from kvkit.validate import check_bool, check_int, check_real, checked, implements, is_int, plural, quote
from kvkit.warn import warn
from kvkit.worker import WAIT_TIMEOUT_S
from kvkit.worker.layouts import (
    allocate_kv,
    check_layouts,
    kv_device,
    kv_nbytes,
    kv_views,
    regions_for,
    validate_kv,
)
from kvkit.worker.memory import check_fits

__all__ = ["TransferEngine", "layer_stages"]

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
            warn(
                f"cudaHostRegister of the {size}-byte CPU KV mirror failed (cudaError {err} at "
                f"offset {offset}); falling back to pageable memory: copies will be several "
                f"times slower and synchronous", RuntimeWarning)
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
    in_doubt: bool = False  # the backend failed while this copy was in flight
    # A layered load: per layer, the device events after which that layer's blocks are written
    # (an empty tuple: already written); None for a load whose layers a reader must wait for whole.
    layers: dict[int, tuple[Any, ...]] | None = None
    load: bool = False


_FIRST_PAUSE_S, _MAX_PAUSE_S = 20e-6, 1e-3
"""A bounded wait polls the backend, sleeping 20 us, 40 us... at most 1 ms between polls."""


_LAYER_NAME = re.compile(r"layer(\d+)(\.[kv])?")
"""Region names of :func:`~kvkit.worker.layouts.regions_for` that hold one layer (``layer3``, ``layer3.k``)."""


def layer_stages(spec: KVCacheSpec, regions: Sequence[Region],
               layers_per_stage: int) -> dict[int, list[tuple[range, tuple[int, ...]]]]:
    """Each group's stages for layered copies: runs of regions holding ``layers_per_stage`` layers, in order.

    A region that holds every layer of its group (cross-layer on both tiers: one
    piece per block) is one stage for all of them: such a load cannot pipeline.
    """
    by_group: dict[int, list[tuple[int, ...]]] = {}
    for r in regions:
        match = _LAYER_NAME.fullmatch(r.name)
        by_group.setdefault(r.group, []).append(
            (int(match.group(1)),) if match else tuple(spec.groups[r.group].layers))
    stages: dict[int, list[tuple[range, tuple[int, ...]]]] = {}
    for group, held in by_group.items():
        out: list[tuple[range, tuple[int, ...]]] = []
        start = 0
        for i in range(1, len(held) + 1):
            layers = tuple(dict.fromkeys(layer for h in held[start:i] for layer in h))
            if i == len(held) or (held[i] != held[i - 1] and len(layers) >= layers_per_stage):
                out.append((range(start, i), layers))
                start = i
        stages[group] = out
    return stages


def _transfer_ids(name: str, value: object) -> frozenset[int]:
    """``value`` as a set of transfer ids, or ``ConfigError`` quoting it: a collection of ints, not a ``str``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Collection):
        raise ConfigError(f"{name}={quote(value)}: must be a collection of transfer ids (ints)")
    bad = [v for v in value if not is_int(v)]
    if bad:
        raise ConfigError(f"{name}={quote(value)}: transfer ids must be ints, got {quote(bad[0])}")
    return frozenset(int(v) for v in value)


def _check_written(written: object, num_layers: int) -> Mapping[int, Any]:
    """``written`` if it is a mapping whose keys are layers of the spec, else ``PlanError`` quoting it."""
    if not isinstance(written, Mapping):
        raise PlanError(f"written={quote(written)}: must be a mapping of layer (int) to event")
    bad = [layer for layer in written if not is_int(layer, 0) or layer >= num_layers]
    if bad:
        raise PlanError(f"written={quote(written)}: key {quote(bad[0])} is not a layer of the spec "
                        f"(0..{num_layers - 1})")
    return written


def _stage_events(events: object, stages: int) -> list[tuple[Any, ...]] | None:
    """A layered load's events per stage, when every stage answered some; ``None``: wait for it whole.

    The :class:`~kvkit.interfaces.capabilities.LayeredCopy` contract answers
    one tuple per stage; an empty one claims the stage already landed, which
    nothing here can verify, so such a load (a host-memory copy, which did
    land) is waited for whole: a poll, not a stale read. An answer that is
    not one tuple per stage breaks the contract: warned of, waited for whole
    (the copy was launched, so it is still reported as it completes).
    """
    if not isinstance(events, Sequence) or len(events) != stages or not all(isinstance(e, tuple) for e in events):
        warn(f"copy backend answered {quote(events)} for {plural(stages, 'stage')}, not one tuple of "
             f"events per stage: the transfer is waited for whole", RuntimeWarning)
        return None
    return list(events) if all(events) else None


def _written_after(written: Mapping[int, Any], layers: tuple[int, ...], fallback: Any) -> Any:
    """The event a store stage waits for: the last of its layers' ``written`` events, if every layer has one.

    Events of one compute stream complete in order, so the last layer's covers the others.
    """
    if all(layer in written for layer in layers):
        return written[max(layers)]
    return fallback


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
        wait_timeout_s: how long :meth:`drain` and :meth:`close` wait by default,
            in seconds (> 0; ``math.inf`` waits forever).

    Invariants:
        * The mirror holds exactly ``num_cpu_blocks`` blocks: one host buffer
          of ``num_cpu_blocks * spec.bytes_per_block`` bytes, page-locked in
          place on CUDA (never rounded up like ``pin_memory=True``).
        * Every copy is ordered after the compute queued on the current stream
          when it was submitted.
        * Every submitted transfer id is reported by :meth:`poll` (or
          :meth:`drain`) exactly once; a failed copy is ``ok=False``, never an
          exception from :meth:`poll`.
        * No write after release: a transfer is reported only once the backend
          confirmed it finished (its handle came back from ``poll``) or never
          started (its ``submit`` raised). When the backend fails (``poll``
          raises), every transfer in flight is *in doubt*: it stays in flight,
          so the scheduler keeps its blocks reserved, and is reported
          ``ok=False`` once a later poll confirms it finished. A backend that
          never recovers keeps them in flight forever; waits time out.
        * Every wait is bounded (``wait_timeout_s`` unless given); a wait that
          times out raises :class:`~kvkit.errors.TransferTimeoutError` and
          leaves every transfer in flight and every buffer in place.
        * A refused call (a typed :mod:`kvkit.errors` error quoting the value)
          changes nothing.
    """

    spec: KVCacheSpec = attrs.field(validator=implements(KVCacheSpec))
    copy: CopyBackend = attrs.field(on_setattr=attrs.setters.frozen)
    num_cpu_blocks: int = attrs.field(kw_only=True, converter=checked(check_int, minimum=1))  # type: ignore[misc]
    worker: int = attrs.field(default=0, kw_only=True, converter=checked(check_int, minimum=0))  # type: ignore[misc]
    wait_timeout_s: float = attrs.field(default=WAIT_TIMEOUT_S, kw_only=True,
                                        converter=checked(check_real, low=0, low_open=True))  # type: ignore[misc]
    layers_per_stage: int = attrs.field(default=1, kw_only=True, converter=checked(check_int, minimum=1))  # type: ignore[misc]
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
    # The mirror's bytes and, per region in order, where its block 0 starts and a block's step and size in them.
    _mirror_bytes: memoryview | None = attrs.field(default=None, init=False, repr=False)
    _cpu_pieces: list[tuple[int, int, int]] = attrs.field(factory=list, init=False, repr=False)
    # Per group: its stages in region order, each (regions, the layers they hold).
    _stages: dict[int, list[tuple[range, tuple[int, ...]]]] = attrs.field(factory=dict, init=False)
    _in_flight: dict[object, _InFlight] = attrs.field(factory=dict, init=False)  # by backend handle, in order
    _ready: list[TransferResult] = attrs.field(factory=list, init=False)  # for the next poll or drain
    _unreported: set[int] = attrs.field(factory=set, init=False)  # ids submitted, not yet handed out
    # The backend's own check, or None: decided once, as the backend is fixed.
    _check_copy: Callable[[], None] | None = attrs.field(default=None, init=False)
    _copy_seconds: Callable[[int], float | None] | None = attrs.field(default=None, init=False)  # a TimedCopy's

    def __attrs_post_init__(self) -> None:
        if isinstance(self.copy, type):  # a class passes the protocol's isinstance check, then fails on use
            raise ConfigError(f"copy must be a CopyBackend instance, got the class {self.copy.__name__}; "
                              f"hint: pass an instance, e.g. {self.copy.__name__}()")
        if not isinstance(self.copy, CopyBackend):
            raise ConfigError(f"copy must implement CopyBackend, got {type(self.copy).__name__}")
        if isinstance(self.copy, SelfChecking):
            self._check_copy = self.copy.check_invariants
        if isinstance(self.copy, TimedCopy):
            self._copy_seconds = self.copy.copy_seconds

    # -- registration -----------------------------------------------------------------

    def register_kv(self, tensors: Sequence[torch.Tensor], layout: str, *,
                    cpu_layout: str | None = None) -> None:
        """Adopt the engine's KV ``tensors`` in ``layout``, build the CPU mirror, register regions.

        The mirror is laid out in ``cpu_layout`` (default: ``layout``); see
        :func:`kvkit.worker.layouts.regions_for` for which layouts pair.
        Everything is checked before the mirror is allocated.

        Raises:
            ConfigError: KV already registered, an unknown layout, or layouts that do not pair.
            SpecMismatchError: the tensors disagree with ``spec`` (see ``validate_kv``).
            InsufficientMemoryError: the mirror does not fit in host memory.
        """
        self._check_unregistered()
        cpu_layout = layout if cpu_layout is None else cpu_layout
        check_layouts(self.spec, layout, cpu_layout)
        validate_kv(self.spec, layout, tensors)
        tensors = list(tensors)
        need = self._mirror_need(cpu_layout)
        check_fits("cpu", need)
        try:
            mirror = torch.empty(sum(need.values()), dtype=torch.uint8)
        except RuntimeError as exc:  # the allocator refused after all (overcommit limits)
            raise InsufficientMemoryError(f"cannot allocate the CPU mirror ({sum(need.values())} bytes): "
                                          f"{exc}") from None
        cpu_kv = kv_views(self.spec, cpu_layout, self.num_cpu_blocks, mirror)
        regions = regions_for(self.spec, layout, tensors, cpu_kv, cpu_layout=cpu_layout)
        pieces = [_piece_slots(r.cpu, mirror) for r in regions]  # refused before anything is registered
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
        self._stages = layer_stages(self.spec, regions, self.layers_per_stage)
        self._mirror_bytes, self._cpu_pieces = mirror.numpy().data, pieces

    def allocate_kv(self, num_gpu_blocks: int, layout: str, device: torch.device | str = "cpu", *,
                    cpu_layout: str | None = None) -> list[torch.Tensor]:
        """Allocate a GPU-tier cache (uninitialised) on ``device`` and register it (simulator use).

        ``cpu_layout`` as in :meth:`register_kv`. Both the cache and the mirror
        are checked against free memory before either is allocated.

        Raises:
            ConfigError: as :meth:`register_kv`, ``num_gpu_blocks`` not an int
                >= 1, or a bad ``device`` (see :func:`~kvkit.worker.layouts.kv_device`).
            InsufficientMemoryError: the cache or the mirror does not fit.
        """
        self._check_unregistered()
        num_gpu_blocks = check_int("num_gpu_blocks", num_gpu_blocks, 1)
        device = kv_device(device)
        check_layouts(self.spec, layout, cpu_layout)
        gpu = {f"GPU tier of num_gpu_blocks={num_gpu_blocks} ({layout})":
               kv_nbytes(self.spec, layout, num_gpu_blocks)}
        mirror = self._mirror_need(layout if cpu_layout is None else cpu_layout)
        if device.type == "cpu":
            check_fits(device, gpu | mirror)
        else:
            check_fits(device, gpu)
            check_fits("cpu", mirror)
        tensors = allocate_kv(self.spec, layout, num_gpu_blocks, device)
        self.register_kv(tensors, layout, cpu_layout=cpu_layout)
        return tensors

    def _check_unregistered(self) -> None:
        if self._layout is not None:
            raise ConfigError(f"KV cache already registered (layout {self._layout!r}); close() first")

    def _mirror_need(self, cpu_layout: str) -> dict[str, int]:
        return {f"CPU mirror of num_cpu_blocks={self.num_cpu_blocks} ({cpu_layout})":
                kv_nbytes(self.spec, cpu_layout, self.num_cpu_blocks)}

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

    def submit(self, transfer_id: int, plan: TransferPlan, *, layered: bool = False,
               written: Mapping[int, Any] | None = None) -> None:
        """Start ``plan`` as transfer ``transfer_id``, ordered after the compute queued so far.

        With ``layered`` and a :class:`~kvkit.interfaces.capabilities.LayeredCopy`
        backend the copy runs layer by layer (``layers_per_stage`` layers a
        stage): a load's layer is readable, through :meth:`wait_layer`, as soon
        as it landed; a store's layer waits only for ``written[layer]`` (an
        event the caller recorded after the kernel that wrote it; a layer
        without one waits for all compute queued so far). Either way the
        transfer is reported once, as a whole. A backend without the capability
        copies the plan whole, and :meth:`wait_layer` waits for all of it.

        A copy that fails to launch is reported by the next :meth:`poll` as
        ``TransferResult(ok=False)``.

        Raises:
            ConfigError: no KV cache registered yet.
            PlanError: ``transfer_id`` is not an int >= 0 or is not reported yet,
                ``layered`` is not a bool, ``written`` is not a mapping of layer ints,
                ``plan`` is not a ``TransferPlan`` of a registered group, or the
                backend rejected the plan; nothing was launched.
        """
        if self._layout is None:
            raise ConfigError("no KV cache registered: call register_kv() or allocate_kv() first")
        transfer_id = check_int("transfer_id", transfer_id, 0, error=PlanError)
        layered = check_bool("layered", layered, error=PlanError)
        if written is not None:
            written = _check_written(written, self.spec.num_layers)
        if transfer_id in self._unreported:
            raise PlanError(f"transfer id {transfer_id!r} is already in flight (not reported yet)")
        if not isinstance(plan, TransferPlan):
            raise PlanError(f"plan must be a TransferPlan, got {type(plan).__name__} {quote(plan)}")
        group_bytes = self._group_block_bytes.get(plan.group)
        if group_bytes is None:
            raise PlanError(f"plan group {plan.group!r} has no registered region; groups: "
                            f"{sorted(self._group_block_bytes)}")
        started = time.perf_counter()
        load, layers = plan.direction is Direction.LOAD, None
        try:
            done = self._compute_done()
            if layered and isinstance(self.copy, LayeredCopy):
                stages = self._stages[plan.group]
                waits = ([done] + [None] * (len(stages) - 1) if written is None
                         else [_written_after(written, held, done) for _, held in stages])
                handle, events = self.copy.submit_stages(plan, [regions for regions, _ in stages], after=waits)
                answered = _stage_events(events, len(stages))
                if load and answered is not None:
                    layers = {layer: ev for (_, held), ev in zip(stages, answered) for layer in held}
            else:
                handle = self.copy.submit(plan, after=done)
        except PlanError:
            raise
        except Exception as exc:  # noqa: BLE001 - launched nothing (the backend contract): a failed result, not a crash
            warn(f"transfer {transfer_id} failed to launch: {exc!r}", RuntimeWarning)
            self._ready.append(TransferResult(transfer_id, self.worker, ok=False))
        else:
            job = _InFlight(transfer_id, started, len(plan) * group_bytes, layers=layers, load=load)
            key: object = handle
            if not is_int(handle) or handle in self._in_flight:
                # The backend broke its contract: its copy may run, but no poll can ever confirm this
                # handle, so the transfer stays in flight, in doubt, under a key no poll returns.
                warn(f"copy backend returned the handle {quote(handle)} for transfer {transfer_id}, not a "
                     f"new int: it stays in flight, in doubt", RuntimeWarning)
                key, job.in_doubt = ("unconfirmable", transfer_id), True
            self._in_flight[key] = job
        self._unreported.add(transfer_id)
        self._collect()  # a copy the backend ran inside submit is timed by submit alone

    def _compute_done(self) -> torch.cuda.Event | None:
        """An event after the compute queued so far (CUDA), which the copy waits for."""
        if self._gpu_kv[0].device.type != "cuda":
            return None
        # A store must not read blocks the queued kernels are still writing; a load
        # must not overwrite blocks queued kernels still read. One event covers both.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._gpu_kv[0].device))
        return event

    def poll(self) -> list[TransferResult]:
        """Results of transfers confirmed finished since the last call (non-blocking).

        ``seconds`` is the copy's own time where the backend measures it (a
        :class:`~kvkit.interfaces.capabilities.TimedCopy`: ``torch``,
        ``cuda-dma``, ``cupy-batch`` and ``auto``, on the host or on a stream,
        waits on other streams not counted); otherwise it runs from
        :meth:`submit` to the first poll that saw the copy done (:meth:`submit`
        polls once after launching), which on a device stream includes
        queueing behind earlier copies and poll latency.
        If the backend's ``poll`` raises, the transfers in flight become in
        doubt (one warning) and stay in flight; see the class invariants.
        """
        self._collect()
        return self._hand_out()

    def drain(self, timeout: float | None = None) -> list[TransferResult]:
        """Wait until every transfer in flight is confirmed finished; return every result not yet reported.

        Waits by polling the backend (its own ``wait`` may block forever) for
        at most ``timeout`` seconds (default :attr:`wait_timeout_s`; ``math.inf``
        waits forever).

        Raises:
            ConfigError: ``timeout`` is not a number >= 0 (nothing changed).
            TransferTimeoutError: transfers still in flight at the deadline
                (``pending``: their ids, in submission order). Nothing is
                released: they stay in flight, and the results collected
                meanwhile are reported by the next poll or drain.
        """
        self._wait_until(lambda: not self._in_flight, self._timeout(timeout))
        return self._hand_out()

    def wait_layer(self, layer: int, stream: Any = None, timeout: float | None = None, *,
                   transfers: Collection[int] | None = None) -> None:
        """Make ``stream`` read ``layer``'s blocks only after every load in flight (of ``transfers``) wrote them.

        A layered load (see :meth:`submit`) costs no host wait: ``stream``
        (default: the current CUDA stream) waits on the device for that
        layer's events. Any other load in flight is waited for whole, on the
        host, for at most ``timeout`` seconds (default :attr:`wait_timeout_s`).
        ``transfers`` limits the wait to those transfer ids (loads that other
        requests' compute does not read, e.g. asynchronous ones, need not
        hold it up). Results stay for :meth:`poll`.

        Raises:
            ConfigError: ``layer`` is not a layer of the spec, ``transfers`` is not a
                collection of ints, or ``timeout`` is not a number >= 0.
            TransferTimeoutError: as :meth:`drain`, for the loads waited for whole.
        """
        layer = check_int("layer", layer, 0)
        if layer >= self.spec.num_layers:
            raise ConfigError(f"layer={quote(layer)}: the spec has layers 0..{self.spec.num_layers - 1}")
        if transfers is not None:
            transfers = _transfer_ids("transfers", transfers)
        limit = self._timeout(timeout)
        whole: set[int] = set()  # (a finished load still listed costs a no-op device wait, or a quick host one)
        for job in self._in_flight.values():
            if not job.load or (transfers is not None and job.transfer_id not in transfers):
                continue
            if job.layers is None:
                whole.add(job.transfer_id)
                continue
            events = job.layers.get(layer, ())
            if events and stream is None:
                stream = torch.cuda.current_stream(self._gpu_kv[0].device)
            for event in events:
                stream.wait_event(event)
        if whole:
            self.wait(whole, limit)

    def wait(self, transfers: Collection[int], timeout: float | None = None) -> None:
        """Block until every transfer of ``transfers`` in flight is confirmed finished; results stay for poll.

        Waits as :meth:`drain` (by polling, at most ``timeout`` seconds), for those transfers only.

        Raises:
            ConfigError: ``transfers`` is not a collection of ints (a ``str`` is not), or
                ``timeout`` is not a number >= 0.
            TransferTimeoutError: as :meth:`drain`.
        """
        wanted = _transfer_ids("transfers", transfers)
        self._wait_until(lambda: wanted.isdisjoint(j.transfer_id for j in self._in_flight.values()),
                         self._timeout(timeout))

    def _wait_until(self, done: Callable[[], bool], limit: float) -> None:
        """Poll the backend until ``done()``, sleeping 20 us doubling to 1 ms; at most ``limit`` seconds."""
        deadline, pause = time.monotonic() + limit, _FIRST_PAUSE_S
        self._collect()
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(limit)
            time.sleep(min(pause, left))
            pause = min(2 * pause, _MAX_PAUSE_S)
            self._collect()

    def _timeout(self, timeout: float | None) -> float:
        return self.wait_timeout_s if timeout is None else check_real("timeout", timeout, low=0)

    def _timed_out(self, limit: float) -> TransferTimeoutError:
        pending = tuple(job.transfer_id for job in self._in_flight.values())
        doubt = self.num_in_doubt
        why = f" ({doubt} in doubt since the copy backend failed)" if doubt else ""
        return TransferTimeoutError(
            f"worker {self.worker}: {plural(len(pending), 'transfer')} still in flight after {limit} s{why}: "
            f"{quote(list(pending))}; they stay in flight and nothing was released", pending)

    def _collect(self) -> None:
        """Move the transfers the backend confirms finished to the results to hand out."""
        if not self._in_flight:
            return
        try:
            handles = list(self.copy.poll())
            known = [h for h in handles if h in self._in_flight]  # handles of other copies are ignored
        except Exception as exc:  # noqa: BLE001 - the backend cannot tell what finished: nothing is confirmed
            self._suspect(exc)
            return
        now = time.perf_counter()
        for handle in known:
            job = self._in_flight.pop(handle, None)
            if job is None:  # reported twice in one poll
                continue
            if job.in_doubt:
                self._ready.append(TransferResult(job.transfer_id, self.worker, ok=False))
            else:
                own = None if self._copy_seconds is None else self._copy_seconds(handle)
                self._ready.append(TransferResult(job.transfer_id, self.worker, ok=True,
                                                  seconds=now - job.started if own is None else own,
                                                  num_bytes=job.num_bytes))

    def _suspect(self, exc: Exception) -> None:
        """The backend failed: every transfer in flight is in doubt until a later poll confirms it finished."""
        fresh = [job for job in self._in_flight.values() if not job.in_doubt]
        for job in fresh:
            job.in_doubt = True
        if fresh:  # once per transfer, however often a broken backend raises
            warn(
                f"copy backend failed: {exc!r}; in doubt now: {plural(len(fresh), 'transfer')} in flight "
                f"{quote([job.transfer_id for job in fresh])}: each is reported failed once the backend "
                f"confirms it finished, and its blocks stay reserved until then", RuntimeWarning)

    def _hand_out(self) -> list[TransferResult]:
        results, self._ready = self._ready, []
        self._unreported.difference_update(r.transfer_id for r in results)
        return results

    @property
    def num_in_flight(self) -> int:
        """Transfers submitted and not yet reported."""
        return len(self._unreported)

    @property
    def num_in_doubt(self) -> int:
        """Transfers in flight when the backend failed, not yet confirmed finished."""
        return sum(job.in_doubt for job in self._in_flight.values())

    # -- inspection -------------------------------------------------------------------

    def block_pieces(self, tier: Tier, block: int, group: int | None = None) -> list[torch.Tensor]:
        """Views of ``block``'s piece in every region (of ``group``, if given), in region order.

        ``tier`` is a :class:`~kvkit.interfaces.Tier` or its value (``"gpu"``, ``"cpu"``).

        Raises:
            ConfigError: no KV registered, ``tier`` not ``"gpu"``/``"cpu"``, or
                ``group`` not a registered KV group.
            UnknownBlockError: ``block`` is not an int in range for that tier.
        """
        if self._layout is None:
            raise ConfigError("no KV cache registered")
        if tier not in (Tier.GPU, Tier.CPU):
            raise ConfigError(f"tier must be 'gpu' or 'cpu', got {quote(tier)}")
        if group is not None and not (is_int(group) and group in self._group_block_bytes):
            raise ConfigError(f"group={quote(group)}: not a registered KV group; groups: "
                              f"{sorted(self._group_block_bytes)}")
        regions = [r for r in self._regions if group is None or r.group == group]
        tensors = [r.gpu if tier == Tier.GPU else r.cpu for r in regions]
        limit = min(t.shape[0] for t in tensors)
        if not is_int(block) or not 0 <= block < limit:
            raise UnknownBlockError(f"{tier} block {quote(block)} out of range [0, {limit})")
        return [t[int(block)] for t in tensors]

    def cpu_block_views(self, block: int) -> list[memoryview]:
        """Byte views of ``block``'s piece in every region of the CPU mirror, in region order (no copy).

        The bytes of :meth:`block_pieces` on the CPU tier, each one contiguous
        ``memoryview`` slice of the mirror, writable: what a block store
        sends from or receives into.

        Raises:
            ConfigError: no KV registered.
            UnknownBlockError: ``block`` is not an int in ``[0, num_cpu_blocks)``.
        """
        if self._mirror_bytes is None:
            raise ConfigError("no KV cache registered")
        if not is_int(block) or not 0 <= block < self.num_cpu_blocks:
            raise UnknownBlockError(f"cpu block {quote(block)} out of range [0, {self.num_cpu_blocks})")
        data = self._mirror_bytes
        return [data[start + block * step: start + block * step + size] for start, step, size in self._cpu_pieces]

    def read_block(self, tier: Tier, block: int, group: int | None = None) -> bytes:
        """The bytes of ``block`` on ``tier``: every region's piece, concatenated in region order."""
        pieces = self.block_pieces(tier, block, group)
        return b"".join(p.contiguous().view(torch.uint8).cpu().numpy().tobytes() for p in pieces)

    # -- lifecycle --------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> list[TransferResult]:
        """Drain (as :meth:`drain`), unregister the mirror and forget the KV cache; returns the last results.

        Idempotent; the engine can register a cache again afterwards.

        Raises:
            ConfigError: ``timeout`` is not a number >= 0.
            TransferTimeoutError: as :meth:`drain`. Then nothing is released: the
                mirror stays allocated, page-locked and registered with the
                backend, and the KV cache stays registered, since a copy may
                still write them; call ``close()`` again once the copies finished.
        """
        results = self.drain(timeout)
        if self._unpin is not None:
            self._unpin()  # after the drain: no copy touches the mirror any more
        self._layout, self._cpu_layout, self._gpu_kv, self._cpu_kv, self._regions = None, None, [], [], []
        self._mirror, self._pinned_chunks, self._unpin, self._group_block_bytes = None, [], None, {}
        self._mirror_bytes, self._cpu_pieces = None, []
        return results

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the mirror or the in-flight bookkeeping is inconsistent."""
        unreported = [job.transfer_id for job in self._in_flight.values()] + [r.transfer_id for r in self._ready]
        assert len(set(unreported)) == len(unreported), f"a transfer id is pending twice: {unreported}"
        assert set(unreported) == self._unreported, (unreported, self._unreported)
        if self._layout is None:
            assert not self._unreported and self._mirror is None and not self._pinned_chunks
            assert self._cpu_layout is None
            return
        assert self._cpu_layout is not None
        assert self._mirror is not None
        assert self._mirror.numel() == self.num_cpu_blocks * self.spec.bytes_per_block
        base = self._mirror.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in self._cpu_kv), "mirror views escaped"
        assert all(job.num_bytes >= 0 for job in self._in_flight.values())
        if self._check_copy is not None:
            self._check_copy()


def _piece_slots(cpu: torch.Tensor, mirror: torch.Tensor) -> tuple[int, int, int]:
    """Where a region's blocks sit in the mirror's bytes: ``(block 0's offset, a block's step, its size)``.

    Every layout gives each block one contiguous piece per region (a
    store's buffers are byte views of it); a layout that did not would be
    refused here, when it is registered.
    """
    piece, item = cpu[0], cpu.element_size()
    if not piece.is_contiguous():
        raise ConfigError(f"a CPU block's piece of shape {tuple(piece.shape)} and strides {piece.stride()} is "
                          f"not contiguous; a block store needs each piece as one run of bytes")
    return cpu.data_ptr() - mirror.data_ptr(), cpu.stride(0) * item, piece.numel() * item
