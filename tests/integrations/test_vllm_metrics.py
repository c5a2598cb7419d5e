"""kvkit's stats payload as vLLM's stat loggers read it: Prometheus series by vLLM's names, and KV events.

Fast: no engine runs. A fresh Prometheus registry per test stands in for
vLLM's; the end-to-end checks against a real OpenAI server's ``/metrics`` and
ZMQ event stream are in ``test_vllm.py``.
"""

import functools
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import msgspec
import prometheus_client
from vllm.distributed.kv_events import KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvkit.integrations.vllm.metrics import NEVER_UNDER_VLLM, SAVE_OUTCOMES, KVKitPromMetrics, KVKitStats, tier_events
from kvkit.integrations.vllm.scheduler import COUNTERS, TierBlock, TierRun
from kvkit.interfaces import BlockHash

GAUGES = {"gpu_blocks_held": 0, "cpu_blocks_pinned": 2, "transfers_in_flight": 1, "cpu_blocks": 8,
          "cpu_blocks_used": 4, "cpu_blocks_storing": 1, "info": ("cpu", "false", "true", "8")}


def _prom():
    registry = prometheus_client.CollectorRegistry()
    types = {cls: functools.partial(cls, registry=registry)
             for cls in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)}
    metrics = KVKitPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                               {0: ["tiny", "0"]})
    return metrics, lambda name, **labels: registry.get_sample_value(name, {"model_name": "tiny", "engine": "0",
                                                                            **labels})


def test_intervals_sum_counters_concatenate_copies_and_keep_the_latest_gauges():
    """vLLM aggregates steps into an interval: counters add, copies join, gauges are the last step's."""
    first = KVKitStats(data={"blocks_stored": 3, "store_copies": [(300, 1e-4)], **GAUGES})
    second = KVKitStats(data={"blocks_stored": 2, "store_copies": [[100, 1e-4]], "load_copies": [[200, 2e-4]],
                              **GAUGES, "cpu_blocks_used": 5})
    merged = first.aggregate(second)
    assert merged.data["blocks_stored"] == 5 and merged.data["cpu_blocks_used"] == 5
    assert merged.data["store_copies"] == [(300, 1e-4), [100, 1e-4]]
    logged = merged.reduce()
    assert logged["transfer_gbps"] == round(600 / 4e-4 / 1e9, 3)
    assert (logged["store_copies"], logged["store_copies_bytes"], logged["load_copies"]) == (2, 400, 1)
    assert "info" not in logged and "gpu_blocks_held" not in logged  # not numbers, and 0
    assert KVKitStats(data={}).is_empty()


def test_one_payload_feeds_kvkits_the_seeds_and_the_offloading_connectors_series():
    """Each family reads the same counters: blocks stored by outcome, loads, copy bytes/time/size, usage."""
    metrics, value = _prom()
    data = {"blocks_stored": 3, "stores_deduplicated": 2, "stores_in_flight": 1, "stores_dropped": 4,
            "blocks_loaded": 2, "evictions_gpu": 7, "store_copies": [[3000, 1e-3]], "load_copies": [[2000, 5e-4]],
            **GAUGES}
    metrics.observe(data)
    metrics.observe({"blocks_stored": 1})
    assert value("vllm:kvkit_blocks_stored_total") == 4
    outcomes = {o: value("vllm:simple_kv_offload_save_outcomes_total", outcome=o) for o in SAVE_OUTCOMES}
    assert outcomes == {"stored": 4, "skipped_already_cached": 2, "skipped_in_flight": 1, "dropped_cpu_full": 4,
                        "dropped_backpressure": None}
    assert value("vllm:simple_kv_offload_load_blocks_total") == 2
    assert (value("vllm:simple_kv_offload_used_blocks"), value("vllm:simple_kv_offload_pending_store_blocks")) == (4, 1)
    assert value("vllm:simple_kv_offload_info", backend="cpu", page_cache="false", lazy_offload="true",
                 capacity_blocks="8") == 1
    assert (value("vllm:kv_offload_store_bytes_total"), value("vllm:kv_offload_store_time_total")) == (3000, 1e-3)
    assert (value("vllm:kv_offload_load_size_count"), value("vllm:kv_offload_load_size_sum")) == (1, 2000)
    assert value("vllm:kv_offload_cpu_cache_usage_perc") == 0.5
    assert value("vllm:kv_offload_cpu_cache_write_usage_perc") == 0.125
    assert value("vllm:kv_offload_cpu_cache_read_usage_perc") == 0.375
    assert value("vllm:kvkit_transfer_gbps") == pytest.approx(5000 / 1.5e-3 / 1e9)
    for name in NEVER_UNDER_VLLM:
        assert value(f"vllm:kvkit_{name}_total") is None
    assert value("vllm:kvkit_cpu_blocks_pinned") == 2


def test_every_kvkit_counter_but_those_that_cannot_move_under_vllm_is_a_series():
    metrics, value = _prom()
    metrics.observe(dict.fromkeys(COUNTERS, 1))
    assert [n for n in COUNTERS if value(f"vllm:kvkit_{n}_total") is None] == list(NEVER_UNDER_VLLM)


def _h(i: int) -> BlockHash:
    return BlockHash(i << 200 | i)


def test_tier_events_decode_with_vllms_schema_chains_cut_where_parents_break():
    """Runs become BlockStored chains (medium CPU/STORAGE, parent of the first block) and BlockRemoved events."""
    runs = [TierRun("cpu", True, [TierBlock(_h(1)), TierBlock(_h(2), _h(1)), TierBlock(_h(7), _h(6))]),
            TierRun("shared", True, [TierBlock(_h(1))]),
            TierRun("cpu", False, [TierBlock(_h(2)), TierBlock(_h(7))])]
    events = tier_events(runs, block_size=32, hash_bytes=32)
    batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(
        msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events)))
    digest = [maybe_convert_block_hash(_h(i).to_bytes(32, "big")) for i in range(8)]  # as vLLM's GPU events
    shapes = [(type(e).__name__, e.medium, e.block_hashes, getattr(e, "parent_block_hash", None))
              for e in batch.events]
    assert shapes == [("BlockStored", "CPU", [digest[1], digest[2]], None),
                      ("BlockStored", "CPU", [digest[7]], digest[6]),
                      ("BlockStored", "STORAGE", [digest[1]], None),
                      ("BlockRemoved", "CPU", [digest[2], digest[7]], None)]
    stored = batch.events[0]
    assert (stored.block_size, stored.token_ids, stored.lora_id, stored.locality) == (32, [], None, "LOCAL")
    assert batch.events[2].locality is None  # the shared tier's store may be anywhere


def test_the_docs_list_every_series_outcome_and_event_field():
    """docs/vllm.md names each gauge, each save outcome and its counter, and every field of vLLM's events."""
    from pathlib import Path

    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvkit.integrations.vllm.scheduler import GAUGES as GAUGE_NAMES

    docs = (Path(__file__).resolve().parents[2] / "docs" / "vllm.md").read_text()
    names = [f"vllm:kvkit_{g}" for g in GAUGE_NAMES] + [f"`{n}`" for n in NEVER_UNDER_VLLM]
    names += [f"`{o}` = `{c}`" for o, c in SAVE_OUTCOMES.items()]
    names += [f"`{f}`" for cls in (BlockStored, BlockRemoved) for f in cls.__struct_fields__]
    assert [n for n in names if n not in docs] == []
