"""The worker side of kvkit's vLLM connector: vLLM's worker calls mapped onto ``TransferEngine``.

vLLM-free. Per step, in vLLM's call order:

1. ``start_load_kv`` (before the forward pass when the step has sync loads,
   after it is launched otherwise): submit the loads; synchronous ones are
   waited for, layer by layer in ``wait_for_layer_load`` when ``layerwise``
   (``save_kv_layer`` records when each layer's KV is written, for its
   stores), else at once; asynchronous ones land while later steps run and their
   requests are reported in ``finished_recving`` (``get_transfer_results``) once
   every load of their step completed. One copy per KV group carries every
   loading request's blocks: a request whose source block failed to fetch
   here is left out of the copies (the others land) and fails alone, while a
   copy that fails as a whole names no block, so it fails every request of
   its step (as the scheduler's batch does). A failed synchronous load's GPU
   blocks (the failed requests' own) become vLLM's ``invalid_block_ids`` in
   its step; a failed asynchronous load's requests are reported in
   ``failed_recving`` (and ``finished_recving``), never as blocks, since vLLM
   maps no block id of a model with several KV groups back to its request.
2. ``wait_for_save`` (after the forward pass, every step, also without
   one): submit the step's stores, ordered after the compute that wrote
   their sources, and collect finished copies (``poll``).
3. ``build_connector_worker_meta``: hand this step's results to the scheduler.

With a shared tier, ``start_load_kv`` first fetches this rank's shard of the
step's shared hits into the CPU mirrors (waited for, each value checked); a
load runs without the requests that read a block whose fetch failed, which
fail (as above: vLLM recomputes what they held); if whose load such a block
breaks is unknown, the copies reading it are not run and reported failed.
``wait_for_save`` then queues the step's puts (write-through of committed
CPU blocks), which later polls report.

Each step is identified by :attr:`StepOrder.step`, so a call repeated or
skipped by vLLM neither repeats nor loses a submission. No copy needs a
barrier: the scheduler side holds a GPU reference on every block a copy
touches until the copy is reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import attrs
import numpy as np
import torch

from kvkit.errors import ConfigError, SpecMismatchError, TransferTimeoutError
from kvkit.integrations.vllm.scheduler import StepOrder
from kvkit.integrations.vllm.settings import ConnectorSettings
from kvkit.interfaces import CopyBackend, KVCacheSpec, KVGroupSpec, TransferPlan, TransferResult
from kvkit.interfaces.shared import BlockStore
from kvkit.shared.client import connect_shared
from kvkit.shared.worker import SharedTierWorker, leave_out
from kvkit.validate import plural
from kvkit.worker.engine import TransferEngine
from kvkit.worker.layouts import layouts_for, validate_kv

__all__ = ["VLLM_LAYOUTS", "WorkerSide", "detect_layout", "group_spec"]

VLLM_LAYOUTS: tuple[str, ...] = ("vllm-cpu", "per-layer", "blocks-first", "latent")
"""The layouts vLLM's attention backends use, per layer: CPU ``[nb, H, bs, 2*D]``;
FlashAttention ``[2, nb, bs, H, D]`` (K/V split); FlashInfer ``[nb, 2, bs, H, D]``;
MLA (CPU and CUDA) ``[nb, bs, D]``, one latent per token."""

def detect_layout(spec: KVCacheSpec, tensors: Sequence[torch.Tensor]) -> str:
    """The one layout of :data:`VLLM_LAYOUTS` that ``tensors`` hold for ``spec`` (among those for its kind).

    Raises:
        SpecMismatchError: no layout fits (the message quotes shape, strides and dtype).
        ConfigError: several fit (two blocks: K/V-split and blocks-first look alike).
    """
    fits = []
    for layout in (layout for layout in VLLM_LAYOUTS if layout in layouts_for(spec)):
        try:
            validate_kv(spec, layout, tensors)
        except SpecMismatchError:
            continue
        fits.append(layout)
    if not fits:
        t = tensors[0]
        raise SpecMismatchError(
            f"vLLM's KV tensors (shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype}, "
            f"{plural(len(tensors), 'layer')}) fit none of kvkit's layouts {list(VLLM_LAYOUTS)} for {spec}; "
            f"permuted (HND) or cross-layer caches are not supported")
    if len(fits) > 1:
        raise ConfigError(f"vLLM's KV tensors fit several layouts {fits}; set "
                          f"kv_connector_extra_config['layout'] to one of them")
    return fits[0]


def _without_head_axis(t: torch.Tensor) -> torch.Tensor:
    """An MLA cache as kvkit's ``latent`` layout ``[nb, bs, D]``: vLLM adds a unit KV-head axis
    (``[nb, 1, bs, D]`` on CPU, ``[nb, bs, 1, D]`` NHD), which a view without it drops (no copy)."""
    if t.dim() == 4 and 1 in (t.shape[1], t.shape[2]):
        return t.squeeze(1 if t.shape[1] == 1 else 2)
    return t


def group_spec(spec: KVCacheSpec, group: int) -> KVCacheSpec:
    """The shape of KV group ``group``'s layers alone (one group of all its layers)."""
    g = spec.groups[group]
    return attrs.evolve(spec, num_layers=len(g.layers),
                        groups=(KVGroupSpec(range(len(g.layers)), g.kind, g.window),))


def _engines(engines: Iterable[TransferEngine]) -> tuple[TransferEngine, ...]:
    """``WorkerSide.engines`` as a tuple (a named converter: mypy's ``attrs`` plugin reads its type)."""
    return tuple(engines)


@attrs.define(eq=False)
class _Receiving:
    """One step's asynchronous loads still in flight here, and the requests waiting for them.

    Attributes:
        tids: the step's load transfers not yet reported.
        ids: the requests waiting for every one of them.
        failed: the waiting requests whose load failed here: those a source
            block of which failed (left out of the copies), or every one if a
            copy failed (a copy carries every waiting request's blocks of its
            group, and its failure names no block).
    """

    tids: set[int]
    ids: tuple[str, ...]
    failed: set[str] = attrs.field(factory=set)


@attrs.define(eq=False)
class WorkerSide:
    """Runs each step's transfers on one vLLM worker: one transfer engine per KV group.

    vLLM's hybrid allocator overlays its KV groups on one buffer (a block id
    belongs to one group at a time), so the layers of different groups may
    share memory; each group gets its own engine and CPU mirror, and CPU block
    ``c`` is block ``c`` of every group's mirror (it holds every group's piece).

    Args:
        engines: one per KV group, each with a mirror of the configured
            number of blocks.
        layer_names: vLLM's attention layer names, per KV group.
        layout: ``"auto"`` or the kvkit layout of vLLM's KV tensors.
        cpu_layout: the CPU mirrors' layout (``None``: the same as vLLM's).
        shared: this rank's side of the shared tier (its payload is a CPU
            block of every group's mirror), or ``None`` without one.
        shared_layout: the CPU layout the shared tier's namespace names.
        shared_store: the store to close with this side (``None``: not ours).

    Invariants: every transfer of a step is submitted exactly once, to the
    engine of its group (without the blocks of the requests that read a block
    whose fetch failed), or (a load of such a block, its reader unknown)
    reported failed without running; every result is handed to the scheduler
    exactly once.
    """

    engines: tuple[TransferEngine, ...] = attrs.field(converter=_engines)
    layer_names: tuple[tuple[str, ...], ...] = attrs.field(
        converter=lambda groups: tuple(tuple(names) for names in groups))
    layout: str = "auto"
    cpu_layout: str | None = None
    layerwise: bool = True
    shared: SharedTierWorker | None = attrs.field(default=None, kw_only=True)
    shared_layout: str | None = attrs.field(default=None, kw_only=True)
    shared_store: BlockStore | None = attrs.field(default=None, kw_only=True)
    _layer_of: dict[str, tuple[int, int]] = attrs.field(init=False)  # layer name -> (group, layer in group)
    _step_loads: set[int] = attrs.field(init=False, factory=set)  # this step's synchronous loads
    _written: list[dict[int, Any]] = attrs.field(init=False)  # per group: layer -> event after its KV write
    _stored_step: int = attrs.field(init=False, default=0)
    _loaded_step: int = attrs.field(init=False, default=0)
    _results: list[TransferResult] = attrs.field(init=False, factory=list)
    _load_targets: dict[int, np.ndarray] = attrs.field(init=False, factory=dict)
    _load_errors: set[int] = attrs.field(init=False, factory=set)
    _receiving: list[_Receiving] = attrs.field(init=False, factory=list)
    _received: set[str] = attrs.field(init=False, factory=set)
    _failed_receiving: set[str] = attrs.field(init=False, factory=set)
    _failed_loads: set[str] = attrs.field(init=False, factory=set)  # left out of their loads: for the scheduler

    @_layer_of.default
    def _name_index(self) -> dict[str, tuple[int, int]]:
        return {name: (g, i) for g, names in enumerate(self.layer_names) for i, name in enumerate(names)}

    @_written.default
    def _no_writes(self) -> list[dict[int, Any]]:
        return [{} for _ in self.engines]

    @classmethod
    def from_settings(cls, settings: ConnectorSettings, layer_names: Sequence[Sequence[str]],
                      rank: int = 0) -> WorkerSide:
        """Per KV group, a transfer engine with the configured copy backend and a mirror of ``num_cpu_blocks``."""
        stack = settings.stack
        engines = [TransferEngine(group_spec(stack.kv, g), cast(CopyBackend, stack.resolve().copy),
                                  num_cpu_blocks=settings.num_cpu_blocks, worker=rank,
                                  wait_timeout_s=stack.wait_timeout_s)
                   for g in range(len(stack.kv.groups))]
        shared = store = None
        if (layout := settings.shared_layout) is not None:  # with a shared tier
            conn = connect_shared(stack, layout=layout)
            shared = SharedTierWorker(stack.kv, conn.store, conn.spec.codec, mirrors=engines, rank=rank,
                                      wait_timeout_s=stack.wait_timeout_s)
            store = conn.store if conn.owned else None
        return cls(engines, layer_names, settings.layout, stack.cpu_layout, settings.layerwise, shared=shared,
                   shared_layout=settings.shared_layout, shared_store=store)

    @property
    def rank(self) -> int:
        """This worker's tensor-parallel rank."""
        return self.engines[0].worker

    @property
    def num_cpu_blocks(self) -> int:
        """Blocks of each group's CPU mirror (the scheduler's CPU pool size)."""
        return self.engines[0].num_cpu_blocks

    @property
    def num_in_flight(self) -> int:
        """Transfers submitted and not yet reported, over every group's engine."""
        return sum(e.num_in_flight for e in self.engines)

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> str:
        """Adopt vLLM's KV tensors (one per layer, groups may overlay); returns the layout used.

        Raises:
            SpecMismatchError / ConfigError: missing layers, tensors that fit no layout, a
                ``cpu_layout`` that cannot pair with theirs (``vllm-cpu`` pairs only with itself),
                or (with a shared tier) CPU mirrors in another layout than its namespace names.
        """
        missing = [name for names in self.layer_names for name in names if name not in kv_caches]
        if missing:
            raise SpecMismatchError(f"vLLM registered no KV tensor for layers {missing!r}; "
                                    f"got {sorted(kv_caches)!r}")
        layouts = set()
        for engine, names in zip(self.engines, self.layer_names, strict=True):
            tensors = [kv_caches[name] for name in names]
            if engine.spec.latent:
                tensors = [_without_head_axis(t) for t in tensors]
            layout = detect_layout(engine.spec, tensors) if self.layout == "auto" else self.layout
            engine.register_kv(tensors, layout, cpu_layout=self.cpu_layout)
            layouts.add(layout)
        assert len(layouts) == 1, f"vLLM's KV groups came in different layouts {sorted(layouts)}"
        mirror = self.engines[0].cpu_layout
        if self.shared is not None and mirror != self.shared_layout:
            raise ConfigError(
                f"the shared tier's namespace names the CPU layout {self.shared_layout!r} (derived where the "
                f"scheduler cannot see vLLM's KV tensors), but this worker's CPU mirror is {mirror!r}; set "
                f"kv_connector_extra_config['cpu_layout'] (or 'layout') to {mirror!r}")
        return layouts.pop()

    def load(self, order: StepOrder) -> None:
        """Start the step's loads (once); synchronous ones are waited for: the forward pass reads them.

        Asynchronous loads (``order.receiving``) are only submitted, ordered
        after the compute queued so far; their requests are received once
        every load of the step completed. A load runs without the blocks of the
        requests that read a block whose fetch failed (``order.targets``), which
        fail (handed to the scheduler by :meth:`take_failed_loads`; a synchronous
        load's also as their blocks, :meth:`take_load_errors`); one that reads such
        a block for no request of ``order.loading`` is not run (reported failed).
        """
        if order.step == self._loaded_step:
            return
        self._loaded_step = order.step
        loads = order.plan.loads
        failed = self.shared.fetch(order.plan.fetches, order.plan.fetch_wait_s) if self.shared is not None else set()
        step = None
        if order.receiving:  # before any result of them can come back
            step = _Receiving({tid for tid, _ in loads}, order.receiving)
            self._receiving.append(step)
        targets = dict(zip(order.loading, order.targets, strict=True))
        if failed and (kept := leave_out(loads, failed, targets)) is not None:
            loads, lost, blocks = kept
            self._failed_loads |= lost
            if step is not None:
                step.failed |= lost
            else:  # vLLM recomputes each such request from its first block here, and any request sharing one
                self._load_errors |= blocks
            failed = set()
        submitted = set()
        for tid, plan in loads:
            self._load_targets[tid] = plan.dst
            if failed and failed.intersection(plan.src.tolist()):  # its CPU bytes are not the block's
                self._collect([TransferResult(tid, self.rank, ok=False)])
            elif not len(plan):  # every block it carried was left out
                self._collect([TransferResult(tid, self.rank)])
            else:
                self._submit(tid, plan, layered=not order.receiving)
                submitted.add(tid)
        if order.receiving:
            self._poll()
        elif submitted:
            self._step_loads = submitted
            if not self.layerwise:
                self._wait_step_loads()

    def wait_layer(self, layer_name: str) -> None:
        """Before ``layer_name`` reads its KV: the step's loads of that layer landed (on the device if layered)."""
        where = self._layer_of.get(layer_name)
        if where is not None and self._step_loads:
            group, layer = where
            self.engines[group].wait_layer(layer, transfers=self._step_loads)

    def layer_saved(self, layer_name: str) -> None:
        """``layer_name``'s KV of this step is written (queued): its stores may start once that kernel ran."""
        where = self._layer_of.get(layer_name)
        if where is None or not self.layerwise or not torch.cuda.is_available():
            return
        if self.engines[where[0]].gpu_kv[0].device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return
        event = torch.cuda.Event()
        event.record()
        self._written[where[0]][where[1]] = event

    def _wait_step_loads(self) -> None:
        """The host waits for this step's synchronous loads, so their failures reach this step's output."""
        for engine in self.engines:
            engine.wait(self._step_loads)
        self._step_loads = set()
        self._poll()

    def take_received(self) -> tuple[set[str], set[str]]:
        """Requests whose asynchronous loads all completed here since the last call (polled now), and those
        of them whose loads failed (a subset: vLLM's ``finished_recving`` and ``failed_recving``)."""
        self._poll()
        received, self._received = self._received, set()
        failed, self._failed_receiving = self._failed_receiving, set()
        return received, failed

    def after_forward(self, order: StepOrder | None) -> None:
        """Submit the step's stores (once), after the compute that wrote them; collect finished copies.

        A step with a synchronous load that failed (its GPU blocks not yet taken by ``take_load_errors``)
        stores nothing: its forward pass attended to those blocks' stale bytes, so every block it computed
        may be wrong until vLLM recomputes it. Its stores are reported failed (a later miss, never a wrong
        byte in the CPU tier). A failed asynchronous load stops no store: no forward pass reads its blocks
        (their request waits until it is received, then vLLM frees them uncached and recomputes it).
        """
        if order is not None and order.step != self._stored_step:
            assert not order.plan.loads or order.step == self._loaded_step, (
                f"step {order.step}: vLLM ran the forward pass before start_load_kv loaded its hits")
            self._stored_step = order.step
            if self._step_loads:
                self._wait_step_loads()
            on_device = self.engines[0].gpu_kv[0].device.type != "cpu"
            for tid, plan in order.plan.stores:
                if self._load_errors:  # this step's forward pass may have read a block whose load failed
                    self._collect([TransferResult(tid, self.rank, ok=False)])
                else:
                    self._submit(tid, plan, written=self._written[plan.group], layered=on_device)
            if self.shared is not None:
                self.shared.put(order.plan.puts)
        self._written = self._no_writes()
        self._poll()

    def take_load_errors(self) -> set[int]:
        """GPU block ids whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_results(self) -> tuple[TransferResult, ...]:
        """Every result since the last call (polled now too)."""
        self._poll()
        results, self._results = tuple(self._results), []
        return results

    def take_failed_loads(self) -> set[str]:
        """Requests left out of their loads since the last call (a source block of theirs failed here), whose
        loads' results may report ``ok``: the scheduler side fails them (``SchedulerSide.completed``). Take them
        with or before :meth:`take_results`."""
        failed, self._failed_loads = self._failed_loads, set()
        return failed

    def close(self) -> None:
        """Drain the shared store's tickets (bounded), then the copies; release the CPU mirrors and the store."""
        if self.shared is not None:
            with contextlib.suppress(TransferTimeoutError):  # a dead store: its buffers are dropped with the mirrors
                self._collect(self.shared.drain())
            if self.shared_store is not None:
                self.shared_store.close()
        for engine in self.engines:
            self._collect(engine.close())

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if a transfer engine is inconsistent."""
        for engine in self.engines:
            engine.check_invariants()
        if self.shared is not None:
            self.shared.check_invariants()
        assert len(self._load_targets) <= self.num_in_flight, "a load target outlived its copy"
        assert all(step.tids for step in self._receiving), "a received step was not reported"

    def _submit(self, tid: int, plan: TransferPlan, written: Mapping[int, Any] | None = None, *,
                layered: bool) -> None:
        """Plan ``tid`` on its group's engine (where the group is the engine's only one, 0).

        Layered (stage by stage) when ``layerwise`` and ``layered``: the
        worker asks for it only where stages help, for synchronous loads (a
        layer's forward waits for its own blocks) and for stores of a device's
        KV (a layer's stores start once its KV is written). An asynchronous
        load is waited for whole, and host stages land inside the call, so
        those go whole, which lets a host-thread copy backend run them while
        the worker goes on.
        """
        self.engines[plan.group].submit(tid, attrs.evolve(plan, group=0), layered=self.layerwise and layered,
                                        written=written or None)

    def _poll(self) -> None:
        for engine in self.engines:
            self._collect(engine.poll())
        if self.shared is not None:
            self._collect(self.shared.take_store_results())

    def _collect(self, results: list[TransferResult]) -> None:
        """Take results: a failed copy fails its asynchronous step's requests, or else its GPU blocks; steps done
        are received."""
        for res in results:
            targets = self._load_targets.pop(res.transfer_id, None)
            if targets is None or res.ok:
                continue
            step = next((step for step in self._receiving if res.transfer_id in step.tids), None)
            if step is not None:
                step.failed.update(step.ids)
            else:
                self._load_errors.update(int(b) for b in targets)
        self._results += results
        if self._receiving and results:
            done = {res.transfer_id for res in results}
            for step in self._receiving:
                step.tids -= done
                if not step.tids:
                    self._received.update(step.ids)
                    self._failed_receiving |= step.failed
            self._receiving = [step for step in self._receiving if step.tids]
