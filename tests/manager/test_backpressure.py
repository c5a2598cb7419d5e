"""Store backpressure: a tier whose writes are slow or queued deep gets fewer, never a waiting engine."""

from __future__ import annotations

import math

import pytest

from kvkit.backends.allocator.pool import BlockPool
from kvkit.backends.blockstore.memory import MemoryStore
from kvkit.backends.eviction.lru import LRUPolicy
from kvkit.backends.store.eager import EagerStore
from kvkit.errors import ConfigError
from kvkit.interfaces import KVCacheSpec, TransferResult
from kvkit.manager import OffloadManager
from kvkit.manager.backpressure import Backpressure, WriteGate

SPEC = KVCacheSpec(num_layers=1, block_size=4, num_kv_heads=1, head_dim=4, dtype="uint8")


def test_the_gate_closes_above_the_high_mark_and_reopens_at_the_low_one():
    """Hysteresis: congested above high_ms until the average falls to low_ms; one probe batch at a time."""
    gate = WriteGate(Backpressure(high_ms=100, low_ms=20, smoothing=1.0))
    assert gate.budget() == math.inf
    gate.started(4)
    gate.finished(4, 0.5)  # 500 ms
    assert gate.congested and gate.budget() == math.inf  # nothing in flight: a probe may go
    gate.started(4)
    assert gate.budget() == 0  # the probe is out: nothing else
    gate.finished(4, 0.05)  # 50 ms: below high, above low: still congested
    assert gate.congested
    gate.started(1)
    gate.finished(1, 0.01)
    assert not gate.congested and gate.in_flight == 0


def test_the_gate_bounds_blocks_in_flight():
    """A queue bound: only as many blocks as the bound minus those in flight may start."""
    gate = WriteGate(Backpressure(max_blocks_in_flight=10))
    gate.started(7)
    assert gate.budget() == 3
    gate.finished(7, 0.0)  # not measured: the average is untouched
    assert gate.budget() == 10 and gate.latency_ms is None


@pytest.mark.parametrize("kwargs", [{"high_ms": 0}, {"low_ms": 50, "high_ms": 10}, {"smoothing": 0},
                                    {"smoothing": 1.5}, {"max_blocks_in_flight": -1}])
def test_bad_bounds_are_refused(kwargs):
    with pytest.raises(ConfigError):
        Backpressure(**kwargs)


def _manager(**kw) -> tuple[OffloadManager, BlockPool]:
    gpu = BlockPool(32, LRUPolicy())
    cpu = BlockPool(32, LRUPolicy())
    return OffloadManager(SPEC, cpu, EagerStore(), gpu=gpu, **kw), gpu


def _computed(mgr, gpu, rid, first_hash):
    mgr.add_request(rid, [first_hash + i for i in range(4)], 17)
    mgr.lookup(rid, 0)
    table = gpu.allocate(5)
    mgr.on_allocated(rid, [table])
    mgr.on_computed(rid, 17)
    return table


def test_slow_cpu_stores_are_dropped_and_counted_never_waited_for():
    """Stores whose copies report seconds above the high mark congest the tier: the next step's stores are
    dropped (counted) while the probe is in flight, and the tier takes stores again once copies are fast."""
    mgr, gpu = _manager(store_backpressure=Backpressure(high_ms=100, low_ms=10, smoothing=1.0))
    _computed(mgr, gpu, "a", 100)
    (tid, _), = mgr.build_step().stores
    mgr.apply_completions([TransferResult(tid, 0, seconds=1.0, num_bytes=1)])  # one second: congested
    _computed(mgr, gpu, "b", 200)
    (probe, _), = mgr.build_step().stores  # nothing in flight: one batch probes the tier
    _computed(mgr, gpu, "c", 300)
    assert mgr.build_step().stores == () and mgr.stats.stores_backpressured.value == 4
    mgr.apply_completions([TransferResult(probe, 0, seconds=0.001, num_bytes=1)])  # fast again
    _computed(mgr, gpu, "d", 400)
    assert len(mgr.build_step().stores) == 1
    mgr.check_invariants()


def test_slow_puts_are_deferred_within_a_bounded_backlog():
    """A congested shared tier: puts wait for a later step (not dropped) up to the CPU pool's size."""
    from kvkit.shared.client import FormatCodec
    from kvkit.shared.scheduler import SharedTierSpec

    spec = SharedTierSpec(store=MemoryStore(), codec=FormatCodec.for_stack(SPEC, 1, model="m", layout="none"))
    mgr, gpu = _manager(shared=spec, put_backpressure=Backpressure(high_ms=100, low_ms=10, smoothing=1.0))
    _computed(mgr, gpu, "a", 100)
    (tid, _), = mgr.build_step().stores
    mgr.apply_completions([TransferResult(tid, 0)])
    (put, _), = mgr.build_step().puts
    mgr.apply_completions([TransferResult(put, 0, seconds=1.0, num_bytes=1)])  # a slow put: congested
    _computed(mgr, gpu, "b", 200)
    (tid, _), = mgr.build_step().stores
    mgr.apply_completions([TransferResult(tid, 0)])
    (probe, _), = mgr.build_step().puts  # nothing in flight: a probe
    _computed(mgr, gpu, "c", 300)
    (tid, _), = mgr.build_step().stores
    mgr.apply_completions([TransferResult(tid, 0)])
    assert mgr.build_step().puts == ()  # deferred behind the probe
    mgr.apply_completions([TransferResult(probe, 0, seconds=0.001, num_bytes=1)])
    (_, plan), = mgr.build_step().puts  # the deferred ones go now
    assert len(plan) == 4 and mgr.stats.puts_backpressured.value == 0
    mgr.check_invariants()
