"""``OffloadStack`` and ``build()``: a working offload tier from names or instances."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs
from typing_extensions import override

from kvkit.config import StackConfig, shown_url
from kvkit.driving import DriveLock
from kvkit.errors import ConfigError, TransferTimeoutError
from kvkit.interfaces import BlockAllocator, OffloadCallback
from kvkit.manager import OffloadManager
from kvkit.registry import COPY
from kvkit.stats import OffloadStats
from kvkit.validate import check_real, plural
from kvkit.worker.memory import check_fits

if TYPE_CHECKING:
    import torch

    from kvkit.interfaces.shared import BlockStore
    from kvkit.shared.worker import SharedTierWorker
    from kvkit.worker.engine import TransferEngine

__all__ = ["OffloadStack", "build"]


@attrs.define(eq=False)
class OffloadStack:
    """Every part of one offload tier, wired together.

    Attributes:
        config: the validated configuration it was built from.
        gpu: the GPU tier's block pool (the engine's prefix cache).
        cpu: the CPU tier's block pool.
        manager: the scheduler side (lookups, step plans, completions).
        workers: one ``TransferEngine`` per worker rank when the stack moves
            real bytes; empty for a scheduler-only stack (simulation), whose
            transfers complete as soon as they are planned.
        shared_workers: with a shared tier, one ``SharedTierWorker`` per rank:
            it runs that rank's whole step plan (fetches, then its engine's
            copies, then puts) and reports every result; empty otherwise.
        shared_store: the shared tier's store (``None`` without one).

    Invariants: the CPU pool and every worker's CPU mirror hold the same
    number of blocks (one source of truth: ``config``).

    Threads: one thread drives a stack at a time. Every manager call that
    changes state holds the stack's drive lock (:mod:`kvkit.driving`) but the
    three made per running request (``append_blocks``, ``extend``,
    ``on_computed``), and an engine loop holds it for a whole step with
    ``with stack.driving():`` (the reference engine does), so those and the
    step's worker calls run inside it too.
    :meth:`close`, from any thread, refuses every later step at once, waits
    for the one running to end, then closes; a call after it raises
    ``RequestStateError``.
    """

    config: StackConfig
    gpu: BlockAllocator
    cpu: BlockAllocator
    manager: OffloadManager
    workers: list[TransferEngine] = attrs.field(factory=list)
    shared_workers: list[SharedTierWorker] = attrs.field(factory=list)
    shared_store: BlockStore | None = None
    owns_shared_store: bool = False

    @override
    def __repr__(self) -> str:
        """The parts and sizes, one line: no private state, and no secret (a store URL's password is ``***``)."""
        c, kv = self.config, self.config.kv
        shape = "none" if kv is None else (
            f"{plural(kv.num_layers, 'layer')} x {plural(kv.num_kv_heads, 'KV head')} x "
            f"{plural(kv.head_dim, 'dim')} ({kv.dtype}), {plural(kv.block_size, 'token')} a block")
        parts = [f"kv={shape}",
                 f"gpu={plural(self.gpu.num_blocks, 'block', grouped=True)} ({_name(c.gpu_eviction)})",
                 f"cpu={plural(self.cpu.num_blocks, 'block', grouped=True)} ({_name(c.cpu_eviction)})",
                 f"store={_name(c.store)}", f"copy={_name(c.copy)}", f"workers={len(self.workers)}"]
        if self.shared_store is not None:
            url = None if c.shared is None else c.shared.url
            parts.append(f"shared={shown_url(url) if isinstance(url, str) else _name(self.shared_store)}")
        return f"OffloadStack({', '.join(parts)})"

    @property
    def stats(self) -> OffloadStats:
        """The manager's counters."""
        return self.manager.stats

    @property
    def callbacks(self) -> tuple[OffloadCallback, ...]:
        """Observers, in call order."""
        return self.manager.callbacks

    @property
    def shared_counts(self) -> dict[str, int]:
        """What the workers found in the shared tier, summed over ranks: missing values (keys a server
        answered without a value: absent, or refused, as by a node with no room for another connection),
        invalid values (each a failed block, never loaded) and transport errors."""
        names = ("missing_values", "invalid_values", "transport_errors")
        return {n: sum(getattr(w, n) for w in self.shared_workers) for n in names}

    @property
    def moves_bytes(self) -> bool:
        """Whether transfers copy real bytes (``workers`` registered a KV cache)."""
        return bool(self.workers)

    def check_invariants(self) -> None:
        """Assert the invariants of every part (pools, manager, workers)."""
        self.manager.check_invariants()
        for worker in self.workers:
            assert worker.num_cpu_blocks == self.cpu.num_blocks, (worker.num_cpu_blocks, self.cpu.num_blocks)
            worker.check_invariants()
        for shared in self.shared_workers:
            shared.check_invariants()

    def driving(self) -> DriveLock:
        """The lock an engine loop holds for a whole step (``with stack.driving(): ...``): :meth:`close` from
        another thread waits for the step to end, and a step entered after it raises ``RequestStateError``."""
        return self.manager.drive_lock

    def close(self, timeout: float | None = None) -> None:
        """Refuse every later step, wait for the running one, drain and release every worker (unpins the CPU
        mirrors); the manager applies the last results.

        ``timeout`` bounds the wait for the running step and each worker's wait
        (default: ``config.wait_timeout_s``, and each worker's ``wait_timeout_s``).
        Called inside a step of its own thread (``stack.driving()`` held), it
        closes at once, and that step's later calls raise ``RequestStateError``.

        Raises:
            ConfigError: ``timeout`` is not a number >= 0 (nothing changed).
            TransferTimeoutError: another thread's step still ran at the deadline
                (then nothing was closed), or a worker still had transfers in
                flight at its deadline (``pending``: their ids, of every such
                worker). Those workers keep their mirrors and transfers (see
                ``TransferEngine.close``); the others are closed. Call again later.
        """
        wait_s = self.config.wait_timeout_s if timeout is None else check_real("timeout", timeout, low=0)
        if not self.manager.drive_lock.shut(wait_s):
            raise TransferTimeoutError(f"another thread's step still ran after {wait_s:g} s; nothing was closed, "
                                       f"no step starts any more: call close() again later")
        try:
            self._close(timeout)
        finally:
            self.manager.drive_lock.release()

    def _close(self, timeout: float | None) -> None:
        """What :meth:`close` does once it holds the drive lock."""
        timeouts = []
        for shared in self.shared_workers:  # the store's tickets first: their CPU blocks stay referenced
            try:
                self.manager.apply_completions(shared.drain(timeout))
            except TransferTimeoutError as exc:
                timeouts.append(exc)
        if not timeouts and self.owns_shared_store:
            assert self.shared_store is not None  # owned, hence opened
            self.shared_store.close()
        for worker in self.workers:
            try:
                self.manager.apply_completions(worker.close(timeout))
            except TransferTimeoutError as exc:
                timeouts.append(exc)
        if timeouts:
            pending = tuple(sorted({tid for exc in timeouts for tid in exc.pending}))
            raise TransferTimeoutError("; ".join(map(str, timeouts)), pending)


def _name(component: object) -> str:
    """A slot's registered name, or its instance's class name (``none`` for no component)."""
    if component is None:
        return "none"
    return component if isinstance(component, str) else type(component).__name__


def build(config: StackConfig | None = None, /, *, layout: str | None = None,
          kv_tensors: Sequence[torch.Tensor] | None = None, **slots: Any) -> OffloadStack:
    """Build a stack from a ``StackConfig`` or from its slots as keywords.

    Example::

        stack = kvkit.build(kv=spec, gpu_blocks=1024, cpu_bytes="8GiB",
                            cpu_eviction="lru", store="eager", copy="torch",
                            layout="per-layer")

    Args:
        config: a ready configuration; or pass its slots as keywords instead.
        layout: allocate a KV cache of ``gpu_blocks`` blocks in this layout on
            ``config.device`` for each of ``world_size`` workers (simulation,
            tests, examples).
        kv_tensors: the engine's own KV tensors in ``layout`` (one worker), a
            list holding at least ``gpu_blocks`` blocks (block ids the GPU pool
            never hands out are never copied), as
            :func:`~kvkit.worker.layouts.validate_kv` checks.
        **slots: ``StackConfig`` fields (``kv``, ``gpu_blocks``, ``cpu_bytes``...).

    Without ``layout`` and ``kv_tensors`` the stack is scheduler-only (then
    ``copy=None`` skips building a copy backend). ``layout`` describes the
    engine's tensors, so it is an argument here; the CPU mirrors' layout is
    kvkit's own choice, so it is a slot: ``config.cpu_layout`` (default: ``layout``).

    Everything is checked before any pool, mirror or tensor is allocated, so
    a refused build allocates nothing.

    Raises:
        ConfigError: every invalid slot at once, quoting the values.
        SpecMismatchError: ``kv_tensors`` disagree with ``kv``, ``layout`` or ``gpu_blocks``.
        InsufficientMemoryError: the pools' bookkeeping, the CPU mirrors and
            the allocated GPU tiers do not fit in free host (or device) memory.
    """
    if config is None:
        config = StackConfig(**slots)
    elif slots:
        raise ConfigError(f"pass a StackConfig or keyword slots, not both; got extra slots {sorted(slots)!r}")
    if kv_tensors is not None and (layout is None or config.world_size != 1):
        raise ConfigError(
            f"kv_tensors needs layout=... and world_size=1 (each worker registers its own), "
            f"got layout={layout!r}, world_size={config.world_size!r}")
    if layout is not None and config.copy is None:
        raise ConfigError(f"layout={layout!r} moves bytes and needs a copy backend, got copy=None "
                          f"(scheduler-only); hint: copy='torch'")
    if layout is None and config.cpu_layout is not None:
        raise ConfigError(f"cpu_layout={config.cpu_layout!r} lays out the workers' CPU mirrors, but "
                          f"without layout=... the stack is scheduler-only and has none")
    if layout is not None and config.world_size > 1 and not isinstance(config.copy, str):
        raise ConfigError(
            f"world_size={config.world_size} needs copy given by name (each worker builds its "
            f"own backend), got the instance {config.copy!r}")
    if layout is not None:
        from kvkit.worker.layouts import check_layouts, validate_kv  # torch only when bytes move

        check_layouts(config.kv, layout, config.cpu_layout)  # before any pool or mirror exists
        if kv_tensors is not None:
            validate_kv(config.kv, layout, kv_tensors, min_blocks=config.gpu_blocks)
    _check_memory(config, layout, allocate_gpu=kv_tensors is None)
    parts = config.resolve()
    gpu = parts.allocator(num_blocks=parts.gpu_blocks, eviction=parts.gpu_eviction)
    cpu = parts.allocator(num_blocks=parts.cpu_blocks, eviction=parts.cpu_eviction)
    conn = None
    if config.shared is not None:
        from kvkit.shared.client import connect_shared

        conn = connect_shared(config, layout=config.cpu_layout or layout or "none")
    shared = None if conn is None else conn.spec
    stack = None
    try:  # a build refused from here on leaves no connection, thread or mirror behind
        manager = OffloadManager(config.kv, cpu, parts.store, gpu=gpu, world_size=config.world_size,
                                 callbacks=parts.callbacks, shared=shared, planner=parts.planner)
        stack = OffloadStack(config, gpu, cpu, manager, shared_store=None if conn is None else conn.store,
                             owns_shared_store=conn is not None and conn.owned)
        if layout is not None:
            from kvkit.worker.engine import TransferEngine  # torch only when bytes move

            for rank in range(config.world_size):
                copy = parts.copy if rank == 0 else COPY.create(cast(str, config.copy), slot="copy",  # a name
                                                                 **config.options.get("copy", {}))
                assert copy is not None  # layout needs a copy backend (checked above)
                worker = TransferEngine(config.kv, copy, num_cpu_blocks=parts.cpu_blocks, worker=rank,
                                        wait_timeout_s=config.wait_timeout_s)
                stack.workers.append(worker)
                if kv_tensors is not None:
                    worker.register_kv(kv_tensors, layout, cpu_layout=config.cpu_layout)
                else:
                    worker.allocate_kv(parts.gpu_blocks, layout, config.device, cpu_layout=config.cpu_layout)
        if conn is not None:
            from kvkit.shared.worker import SharedTierWorker

            engines: Sequence[TransferEngine | None] = stack.workers or [None] * config.world_size
            stack.shared_workers = [SharedTierWorker(config.kv, conn.store, conn.spec.codec, engine, rank=rank,
                                                     wait_timeout_s=config.wait_timeout_s)
                                    for rank, engine in enumerate(engines)]
    except BaseException:
        for worker in [] if stack is None else stack.workers:
            with contextlib.suppress(Exception):  # the refusal is what the caller sees
                worker.close(0.0)
        if conn is not None and conn.owned:
            conn.store.close()
        raise
    return stack


def _check_memory(config: StackConfig, layout: str | None, *, allocate_gpu: bool) -> None:
    """Refuse a stack whose pools, mirrors and allocated GPU tiers do not fit this machine now."""
    host = config.pool_bytes()
    if layout is not None:
        n, block = config.world_size, config.kv.bytes_per_block
        mirrors = f"{plural(n, 'CPU mirror')} of {plural(config.num_cpu_blocks, 'block')}"
        host[mirrors] = n * config.num_cpu_blocks * block
        if allocate_gpu:
            gpu = {f"{plural(n, 'GPU tier')} of gpu_blocks={config.gpu_blocks}": n * config.gpu_blocks * block}
            if config.device == "cpu":
                host |= gpu
            else:
                check_fits(config.device, gpu)
    check_fits("cpu", host)
