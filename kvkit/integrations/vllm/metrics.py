"""kvkit's counters in vLLM's connector stats and Prometheus metrics, and its CPU tier in vLLM's KV events.

The scheduler side reports, every step, the increase of each
:class:`~kvkit.stats.OffloadStats` counter and the gauges of
:data:`~kvkit.integrations.vllm.scheduler.GAUGES` (:class:`KVKitStats`);
vLLM carries them to its stat loggers, which log :meth:`KVKitStats.reduce`
and feed :class:`KVKitPromMetrics`: one counter ``vllm:kvkit_<name>`` per
kvkit counter (exposed with Prometheus' ``_total`` suffix), one gauge per
kvkit gauge, and ``vllm:kvkit_transfer_gbps``, the copy bandwidth of the
last interval. Only imported with vLLM.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.utils import create_metric_per_engine

from kvkit.integrations.vllm.scheduler import COUNTERS, GAUGES
from kvkit.interfaces import BlockHash

__all__ = ["KVKitPromMetrics", "KVKitStats", "cpu_tier_events"]


class KVKitStats(KVConnectorStats):
    """One interval of kvkit's stats: counter increases (summed) and gauges (the latest value).

    Invariants: every counter value is >= 0; ``data`` holds only names of
    :data:`COUNTERS` and :data:`GAUGES`.
    """

    @override
    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    @override
    def aggregate(self, other: KVConnectorStats) -> KVKitStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value if name in COUNTERS else value
        return KVKitStats(data=merged)

    @override
    def reduce(self) -> dict[str, int | float]:
        out = {name: value for name, value in self.data.items() if value}
        seconds = self.data.get("transfer_seconds", 0)
        if seconds:
            out["transfer_gbps"] = round(self.data.get("transfer_bytes", 0) / seconds / 1e9, 3)
        return out

    @override
    def is_empty(self) -> bool:
        return not self.data


class KVKitPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvkit_*`` Prometheus metrics, one child per engine (vLLM's labels)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def per_engine(cls: type, name: str, doc: str) -> dict[int, Any]:
            metric = cls(name=f"vllm:kvkit_{name}", documentation=doc, labelnames=labelnames)
            return create_metric_per_engine(metric, per_engine_labelvalues)

        self._counters = {name: per_engine(self._counter_cls, name, f"kvkit OffloadStats.{name} (kvkit.stats)")
                          for name in COUNTERS}
        self._gauges = {name: per_engine(self._gauge_cls, name, f"kvkit's {name.replace('_', ' ')} now")
                        for name in GAUGES}
        self._gbps = per_engine(self._gauge_cls, "transfer_gbps",
                                "GB/s kvkit's copies moved over the last stats interval")

    @override
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._counters:
                if value:
                    self._counters[name][engine_idx].inc(value)
            elif name in self._gauges:
                self._gauges[name][engine_idx].set(value)
        seconds = transfer_stats_data.get("transfer_seconds", 0)
        if seconds:
            self._gbps[engine_idx].set(transfer_stats_data.get("transfer_bytes", 0) / seconds / 1e9)


def cpu_tier_events(runs: list[tuple[bool, list[BlockHash]]], *, block_size: int,
                    hash_bytes: int) -> list[KVCacheEvent]:
    """vLLM's ``BlockStored``/``BlockRemoved`` events (medium ``CPU``), one per run of hashes stored or removed.

    A kvkit hash is the big-endian integer of vLLM's ``hash_bytes``-byte block
    hash, so the events carry vLLM's own hashes (as vLLM's GPU events do).
    kvkit keeps no tokens and one CPU block serves every KV group: the events
    carry no token ids and no group.
    """
    events: list[KVCacheEvent] = []
    for stored, hashes in runs:
        external = [maybe_convert_block_hash(h.to_bytes(hash_bytes, "big")) for h in hashes]
        events.append(BlockStored(block_hashes=external, parent_block_hash=None, token_ids=[],
                                  block_size=block_size, lora_id=None, medium=MEDIUM_CPU, lora_name=None)
                      if stored else BlockRemoved(block_hashes=external, medium=MEDIUM_CPU))
    return events
