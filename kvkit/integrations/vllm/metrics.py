"""kvkit's counters in vLLM's connector stats and Prometheus metrics, and its tiers in vLLM's KV events.

The scheduler side reports, every step, :meth:`SchedulerSide.stats_delta
<kvkit.integrations.vllm.scheduler.SchedulerSide.stats_delta>` as
:class:`KVKitStats`: the increase of each :class:`~kvkit.stats.OffloadStats`
counter, the step's GPU <-> CPU copies (:data:`COPIES`), the gauges of
:data:`GAUGES` and the seed's info labels. vLLM carries them to its stat
loggers, which log :meth:`KVKitStats.reduce` and feed
:class:`KVKitPromMetrics`, which exports three families from that one payload:

* kvkit's own, ``vllm:kvkit_<name>``: one counter per kvkit counter
  (Prometheus adds ``_total``) except :data:`NEVER_UNDER_VLLM`, one gauge per
  gauge, and ``vllm:kvkit_transfer_gbps``, the interval's copy bandwidth:
  bytes over the copies' own time (see :meth:`TransferEngine.poll
  <kvkit.worker.engine.TransferEngine.poll>`);
* vLLM's ``SimpleCPUOffloadConnector``'s ``vllm:simple_kv_offload_*``
  (:data:`SAVE_OUTCOMES` names the counter behind each ``outcome``);
* vLLM's ``OffloadingConnector``'s ``vllm:kv_offload_*``: load and store
  bytes and time (counters) and size (histogram, one observation per copy
  and worker), and the CPU tier's usage gauges, with vLLM's own definitions.

:func:`tier_events` turns the CPU and shared tiers' stores and removals into
vLLM's self-describing ``BlockStored`` / ``BlockRemoved`` events (medium
``CPU`` and ``STORAGE``). Only imported with vLLM.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import get_connector_metric_definitions
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys
from vllm.v1.kv_offload.base import OffloadingHistogramMetadata
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.metrics.utils import create_metric_per_engine
from vllm.v1.simple_kv_offload.metrics import INFO_LABELS, MetricName

from kvkit.integrations.vllm.scheduler import COPIES, COUNTERS, GAUGES, INFO_KEY, TierBlock, TierRun
from kvkit.interfaces import BlockHash

__all__ = ["NEVER_UNDER_VLLM", "SAVE_OUTCOMES", "KVKitPromMetrics", "KVKitStats", "copy_gbps", "tier_events"]

NEVER_UNDER_VLLM: tuple[str, ...] = ("evictions_gpu", "forced_resets", "hit_tokens_overlapped")
"""Counters with no ``vllm:kvkit_*`` series, as they cannot move under vLLM: vLLM's GPU pool evicts
without telling kvkit, vLLM's ``reset_prefix_cache`` resets kvkit's CPU tier only after its copies
drained, and vLLM loads a hit before any of its request's compute (plans have no head)."""

SAVE_OUTCOMES: dict[str, str] = {
    "stored": "blocks_stored",
    "dropped_cpu_full": "stores_dropped",
    "skipped_already_cached": "stores_deduplicated",
    "skipped_in_flight": "stores_in_flight",
    "dropped_backpressure": "stores_backpressured",
}
"""``vllm:simple_kv_offload_save_outcomes_total``'s ``outcome`` label -> the kvkit counter it counts
(blocks). The seed's ``dropped_request_gone``, ``dropped_null_block`` and ``dropped_not_hashed``
cannot happen in kvkit (an ended request's stores hold their GPU blocks; null and unhashed blocks
are never store candidates); ``dropped_backpressure`` is kvkit's own (the CPU tier's writes were
congested)."""

_LOAD, _STORE = COPIES
_COPY_SERIES = {_LOAD: ("vllm:kv_offload_load_bytes", "vllm:kv_offload_load_time", "vllm:kv_offload_load_size"),
                _STORE: ("vllm:kv_offload_store_bytes", "vllm:kv_offload_store_time", "vllm:kv_offload_store_size")}
"""Per :data:`COPIES` key, the ``OffloadingConnector``'s bytes and time counters and size histogram."""


def copy_gbps(copies: list[Any]) -> float | None:
    """GB/s of ``(bytes, seconds)`` copies over their own time summed; ``None`` without any timed one."""
    seconds = sum(c[1] for c in copies)
    return sum(c[0] for c in copies) / seconds / 1e9 if seconds else None


class KVKitStats(KVConnectorStats):
    """One interval of kvkit's stats: counter increases (summed), copies (concatenated), gauges (the latest).

    Invariants: every counter value is >= 0; ``data`` holds only names of
    :data:`COUNTERS`, :data:`COPIES`, :data:`GAUGES` and the info labels.
    """

    @override
    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    @override
    def aggregate(self, other: KVConnectorStats) -> KVKitStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            if name in COUNTERS:
                merged[name] = merged.get(name, 0) + value
            elif name in COPIES:
                merged[name] = [*merged.get(name, ()), *value]
            else:
                merged[name] = value
        return KVKitStats(data=merged)

    @override
    def reduce(self) -> dict[str, int | float]:
        """The counters and gauges that are not 0, each copy direction's count and bytes, and the bandwidth."""
        out: dict[str, int | float] = {name: value for name, value in self.data.items()
                                       if value and (name in COUNTERS or name in GAUGES)}
        for name in COPIES:
            if copies := self.data.get(name):
                out[name] = len(copies)
                out[f"{name}_bytes"] = sum(c[0] for c in copies)
        gbps = copy_gbps([c for name in COPIES for c in self.data.get(name, ())])
        if gbps is not None:
            out["transfer_gbps"] = round(gbps, 3)
        return out

    @override
    def is_empty(self) -> bool:
        return not self.data


class KVKitPromMetrics(KVConnectorPromMetrics):
    """kvkit's, the seed's and the ``OffloadingConnector``'s series (see the module docstring), one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls: type, name: str, doc: str, **kwargs: Any) -> dict[int, Any]:
            metric = cls(name=name, documentation=doc, labelnames=labelnames, **kwargs)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self._counters = {name: per_engine(self._counter_cls, f"vllm:kvkit_{name}",
                                           f"kvkit OffloadStats.{name} (kvkit.stats)")
                          for name in COUNTERS if name not in NEVER_UNDER_VLLM}
        self._gauges = {name: per_engine(self._gauge_cls, f"vllm:kvkit_{name}", f"kvkit's {name.replace('_', ' ')} now")
                        for name in GAUGES}
        self._gbps = per_engine(self._gauge_cls, "vllm:kvkit_transfer_gbps",
                                "GB/s of kvkit's GPU <-> CPU copies over the last stats interval: bytes over the "
                                "copies' own time")
        # The seed's (vLLM's SimpleCPUOffloadConnector) series.
        self._outcomes = self._counter_cls(
            name=MetricName.SAVE_OUTCOMES, labelnames=[*labelnames, "outcome"],
            documentation="Store decisions of kvkit's CPU tier by outcome, in blocks (kvkit.integrations.vllm.metrics"
                          ".SAVE_OUTCOMES)")
        self._load_blocks = per_engine(self._counter_cls, MetricName.LOAD_BLOCKS,
                                       "KV blocks kvkit loaded from its CPU tier to the GPU, counted when a load "
                                       "finishes")
        self._used_blocks = per_engine(self._gauge_cls, MetricName.USED_BLOCKS,
                                       "kvkit's CPU blocks not free: pinned by hits or transfers, or being written "
                                       "(capacity minus empty and evictable)")
        self._pending_stores = per_engine(self._gauge_cls, MetricName.PENDING_STORE_BLOCKS,
                                          "kvkit's CPU blocks that GPU -> CPU stores in flight write")
        self._info = self._gauge_cls(name=MetricName.INFO, labelnames=[*labelnames, *INFO_LABELS],
                                     documentation="kvkit's CPU tier: always 1; backend is cpu or the shared tier's "
                                                   "store, capacity_blocks the CPU tier's size")
        # The OffloadingConnector's series, with vLLM's own names, documentation and buckets.
        definitions = {**get_connector_metric_definitions(), **CPUOffloadingSpec.build_metric_definitions({})}

        def offload(name: str) -> dict[int, Any]:
            meta = definitions[name]
            if isinstance(meta, OffloadingHistogramMetadata):
                return per_engine(self._histogram_cls, name, meta.documentation, buckets=meta.buckets)
            return per_engine(self._counter_cls, name, meta.documentation)

        self._copy_series = {key: tuple(offload(name) for name in names) for key, names in _COPY_SERIES.items()}
        self._usage = {name: per_engine(self._gauge_cls, name, definitions[name].documentation)
                       for name in (CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC,
                                    CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC,
                                    CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC)}

    @override
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for name, value in data.items():
            if name in self._counters:
                if value:
                    self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)
        engine = self.per_engine_labelvalues[engine_idx]
        for outcome, counter in SAVE_OUTCOMES.items():
            if data.get(counter):
                self._outcomes.labels(*engine, outcome).inc(data[counter])
        if data.get("blocks_loaded"):
            self._load_blocks[engine_idx].inc(data["blocks_loaded"])
        if "cpu_blocks" in data:
            capacity, used, storing = data["cpu_blocks"], data["cpu_blocks_used"], data["cpu_blocks_storing"]
            self._used_blocks[engine_idx].set(used)
            self._pending_stores[engine_idx].set(storing)
            usage, write = used / capacity, storing / capacity
            for name, value in zip(self._usage, (usage, write, max(usage - write, 0.0)), strict=True):
                self._usage[name][engine_idx].set(value)
        if INFO_KEY in data:
            self._info.labels(*engine, *data[INFO_KEY]).set(1)
        for key, (moved, took, size) in self._copy_series.items():
            for num_bytes, seconds in data.get(key, ()):
                moved[engine_idx].inc(num_bytes)
                took[engine_idx].inc(seconds)
                size[engine_idx].observe(num_bytes)
        gbps = copy_gbps([c for key in COPIES for c in data.get(key, ())])
        if gbps is not None:
            self._gbps[engine_idx].set(gbps)


_MEDIUM = {"cpu": MEDIUM_CPU, "shared": MEDIUM_STORAGE}
_LOCALITY = {"cpu": "LOCAL", "shared": None}
"""The CPU tier is this engine's memory; the shared tier's store may be anywhere (unspecified)."""


def tier_events(runs: list[TierRun], *, block_size: int, hash_bytes: int) -> list[KVCacheEvent]:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` events for the tiers' runs, in order.

    A kvkit hash is the big-endian integer of vLLM's ``hash_bytes``-byte block
    hash, so events carry vLLM's own hashes (as its GPU events do), converted
    as vLLM converts them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). A stored
    run becomes one ``BlockStored`` per chain: consecutive blocks of one
    request where each block's parent is the block before, carrying the
    first block's ``parent_block_hash``, the chain's ``token_ids`` (when its
    request is known; else none), ``block_size``, the request's LoRA id and
    name, ``extra_keys`` (one entry per block, vLLM's own) and its session.
    A CPU block holds every KV group's piece, so events name no group. A
    removed run becomes one ``BlockRemoved``.
    """
    events: list[KVCacheEvent] = []

    def external(h: BlockHash) -> Any:
        return maybe_convert_block_hash(h.to_bytes(hash_bytes, "big"))

    for run in runs:
        medium, locality = _MEDIUM[run.tier], _LOCALITY[run.tier]
        if not run.stored:
            events.append(BlockRemoved(block_hashes=[external(b.block_hash) for b in run.blocks], medium=medium,
                                       locality=locality))
            continue
        for chain in _chains(run.blocks):
            head, request = chain[0], chain[0].request
            lora = getattr(request, "lora_request", None)
            extra = None
            tokens: list[int] = []
            if request is not None:
                spans = [(b.index * block_size, (b.index + 1) * block_size) for b in chain]
                tokens = list(request.all_token_ids[spans[0][0]:spans[-1][1]])
                extra = to_event_extra_keys([generate_block_hash_extra_keys(request, start, stop, 0)[0]
                                             for start, stop in spans])
            events.append(BlockStored(
                block_hashes=[external(b.block_hash) for b in chain],
                parent_block_hash=None if head.parent is None else external(head.parent),
                token_ids=tokens, block_size=block_size, lora_id=None if lora is None else lora.adapter_id,
                medium=medium, lora_name=None if lora is None else lora.name, extra_keys=extra,
                locality=locality, session_id=getattr(request, "session_id", None)))
    return events


def _chains(blocks: list[TierBlock]) -> list[list[TierBlock]]:
    """``blocks`` cut where a block is not the next of the one before in one request's chain."""
    chains: list[list[TierBlock]] = []
    for b in blocks:
        last = chains[-1][-1] if chains else None
        if (last is not None and b.request is last.request and b.parent == last.block_hash
                and (b.request is None or b.index == last.index + 1)):
            chains[-1].append(b)
        else:
            chains.append([b])
    return chains
