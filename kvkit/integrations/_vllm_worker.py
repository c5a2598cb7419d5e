"""The worker side of kvkit's vLLM connector: vLLM's worker calls mapped onto ``TransferEngine``.

vLLM-free. Per step, in vLLM's call order:

1. ``handle_preemptions`` (first thing, every step, before anything can
   overwrite a block): submit the step's stores, whose sources were confirmed
   in earlier steps; on a barrier, wait for every copy in flight.
2. ``start_load_kv`` (before the forward pass when the step has sync loads):
   submit the loads and wait for them; failed loads become vLLM's
   ``invalid_block_ids``.
3. ``wait_for_save``: collect finished copies (``poll``).
4. ``get_finished``: report released requests as ``finished_sending``.
5. ``build_connector_worker_meta``: hand this step's results to the scheduler.

Each step is identified by :attr:`StepOrder.step`, so a call repeated or
skipped by vLLM (no-forward steps) neither repeats nor loses a submission.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np
import torch

from kvkit.errors import ConfigError, SpecMismatchError
from kvkit.integrations._vllm_scheduler import StepOrder
from kvkit.integrations._vllm_settings import ConnectorSettings
from kvkit.interfaces import KVCacheSpec, TransferResult
from kvkit.worker.engine import TransferEngine
from kvkit.worker.layouts import validate_kv

__all__ = ["VLLM_LAYOUTS", "WorkerSide", "detect_layout"]

VLLM_LAYOUTS: tuple[str, ...] = ("vllm-cpu", "per-layer", "blocks-first")
"""The layouts vLLM's attention backends use, per layer: CPU ``[nb, H, bs, 2*D]``;
FlashAttention ``[2, nb, bs, H, D]`` (K/V split); FlashInfer ``[nb, 2, bs, H, D]``."""

_REMEMBER_FINISHED = 1 << 16  # finished ids remembered until vLLM may expect them back


def detect_layout(spec: KVCacheSpec, tensors: Sequence[torch.Tensor]) -> str:
    """The one layout of :data:`VLLM_LAYOUTS` that ``tensors`` hold for ``spec``.

    Raises:
        SpecMismatchError: no layout fits (the message quotes shape, strides and dtype).
        ConfigError: several fit (two blocks: K/V-split and blocks-first look alike).
    """
    fits = []
    for layout in VLLM_LAYOUTS:
        try:
            validate_kv(spec, layout, tensors)
        except SpecMismatchError:
            continue
        fits.append(layout)
    if not fits:
        t = tensors[0]
        raise SpecMismatchError(
            f"vLLM's KV tensors (shape {tuple(t.shape)}, strides {t.stride()}, {t.dtype}, "
            f"{len(tensors)} layers) fit none of kvkit's layouts {list(VLLM_LAYOUTS)} for {spec}; "
            f"permuted (HND) or cross-layer caches are not supported")
    if len(fits) > 1:
        raise ConfigError(f"vLLM's KV tensors fit several layouts {fits}; set "
                          f"kv_connector_extra_config['layout'] to one of them")
    return fits[0]


@attrs.define(eq=False)
class WorkerSide:
    """Runs each step's transfers on one vLLM worker.

    Args:
        engine: this worker's transfer engine (its CPU mirror has the
            configured number of blocks).
        layer_names: vLLM's attention layer names, in KV-group order.
        layout: ``"auto"`` or the kvkit layout of vLLM's KV tensors.
        cpu_layout: the CPU mirror's layout (``None``: the same as vLLM's).

    Invariants: every transfer of a step is submitted exactly once; every
    result is handed to the scheduler exactly once.
    """

    engine: TransferEngine
    layer_names: list[str] = attrs.field(converter=list)
    layout: str = "auto"
    cpu_layout: str | None = None
    _stored_step: int = attrs.field(init=False, default=0)
    _loaded_step: int = attrs.field(init=False, default=0)
    _released_step: int = attrs.field(init=False, default=0)
    _results: list[TransferResult] = attrs.field(init=False, factory=list)
    _load_targets: dict[int, np.ndarray] = attrs.field(init=False, factory=dict)
    _load_errors: set[int] = attrs.field(init=False, factory=set)
    _finished: dict[str, None] = attrs.field(init=False, factory=dict)
    _to_release: list[str] = attrs.field(init=False, factory=list)

    @classmethod
    def from_settings(cls, settings: ConnectorSettings, layer_names: Sequence[str],
                      rank: int = 0) -> WorkerSide:
        """A transfer engine with the configured copy backend and a mirror of ``num_cpu_blocks``."""
        parts = settings.stack.resolve()
        engine = TransferEngine(settings.stack.kv, parts.copy, num_cpu_blocks=parts.cpu_blocks,
                                worker=rank)
        return cls(engine, layer_names, settings.layout, settings.stack.cpu_layout)

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> str:
        """Adopt vLLM's KV tensors (one per layer); returns the layout used.

        Raises:
            SpecMismatchError / ConfigError: missing layers, tensors that fit no layout, or a
                ``cpu_layout`` that cannot pair with theirs (``vllm-cpu`` pairs only with itself).
        """
        missing = [name for name in self.layer_names if name not in kv_caches]
        if missing:
            raise SpecMismatchError(f"vLLM registered no KV tensor for layers {missing!r}; "
                                    f"got {sorted(kv_caches)!r}")
        tensors = [kv_caches[name] for name in self.layer_names]
        layout = detect_layout(self.engine.spec, tensors) if self.layout == "auto" else self.layout
        self.engine.register_kv(tensors, layout, cpu_layout=self.cpu_layout)
        return layout

    def before_forward(self, order: StepOrder) -> None:
        """Submit the step's stores (once); on a barrier, finish every copy in flight."""
        if order.step == self._stored_step:
            return
        self._stored_step = order.step
        for tid, plan in order.plan.stores:
            self.engine.submit(tid, plan)
        if order.barrier:
            self._collect(self.engine.drain())

    def load(self, order: StepOrder) -> None:
        """Run the step's loads (once) and wait for them: the forward pass reads them."""
        self.before_forward(order)
        if order.step == self._loaded_step:
            return
        self._loaded_step = order.step
        for tid, plan in order.plan.loads:
            self._load_targets[tid] = plan.dst
            self.engine.submit(tid, plan)
        if order.plan.loads:
            self._collect(self.engine.drain())

    def after_forward(self, order: StepOrder | None) -> None:
        """Submit stores a step skipped (none do in vLLM 0.32); collect finished copies."""
        if order is not None:
            self.before_forward(order)
            assert not order.plan.loads or order.step == self._loaded_step, (
                f"step {order.step}: vLLM ran the forward pass before start_load_kv loaded its hits")
        self._collect(self.engine.poll())

    def finished_sending(self, finished_req_ids: Iterable[str], order: StepOrder | None) -> set[str] | None:
        """Released requests vLLM has told this worker about (this call or earlier)."""
        for rid in finished_req_ids:
            self._finished[rid] = None
        if len(self._finished) > _REMEMBER_FINISHED:
            for rid in list(self._finished)[: len(self._finished) - _REMEMBER_FINISHED]:
                del self._finished[rid]
        if order is not None and order.step != self._released_step:
            self._released_step = order.step
            self._to_release += order.release
        ready = {rid for rid in self._to_release if rid in self._finished}
        if ready:
            self._to_release = [rid for rid in self._to_release if rid not in ready]
            for rid in ready:
                del self._finished[rid]
        return ready or None

    def take_load_errors(self) -> set[int]:
        """GPU block ids whose load failed since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_results(self) -> tuple[TransferResult, ...]:
        """Every result since the last call (polled now too)."""
        self._collect(self.engine.poll())
        results, self._results = tuple(self._results), []
        return results

    def close(self) -> None:
        """Drain and release the CPU mirror."""
        self._collect(self.engine.close())

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the transfer engine is inconsistent."""
        self.engine.check_invariants()
        assert len(self._load_targets) <= self.engine.num_in_flight, "a load target outlived its copy"

    def _collect(self, results: list[TransferResult]) -> None:
        for res in results:
            targets = self._load_targets.pop(res.transfer_id, None)
            if targets is not None and not res.ok:
                self._load_errors.update(int(b) for b in targets)
        self._results += results
