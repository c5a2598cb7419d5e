"""Bounded waits: drain and close give up after a timeout, leaving every transfer in flight, every buffer in place."""

import math
import time

import pytest

import kvkit
from kvkit.errors import ConfigError, TransferTimeoutError
from kvkit.hashing import hash_blocks
from kvkit.interfaces import TransferPlan
from kvkit.reference.engine import ReferenceEngine
from kvkit.testing import ThreadedCopy
from kvkit.testing.kvdata import fill_random
from kvkit.worker import WAIT_TIMEOUT_S
from kvkit.worker.engine import TransferEngine

SPEC = kvkit.KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")


@pytest.fixture
def gates():
    """Gates the test holds copies with; all open at teardown, so no pool thread outlives the test."""
    held = []
    yield held
    for gate in held:
        gate.set()


def _engine(gates, **kwargs):
    """An engine on a ThreadedCopy (random bytes in both tiers) whose next copies never complete until released."""
    backend = ThreadedCopy()
    engine = TransferEngine(SPEC, backend, num_cpu_blocks=4, **kwargs)
    fill_random(engine.allocate_kv(4, "per-layer") + engine.cpu_kv, seed=2)
    gates.append(backend.hold())
    return engine, backend, gates[-1]


def test_drain_times_out_within_its_timeout_quoting_the_pending_ids(gates):
    """Copies that never complete: drain raises TransferTimeoutError after ~timeout; released, they complete."""
    engine, _, gate = _engine(gates)
    want = [engine.read_block("gpu", 0), engine.read_block("gpu", 1), engine.read_block("cpu", 0)]
    engine.submit(7, TransferPlan([0, 1], [2, 3], "store"))
    engine.submit(8, TransferPlan([0], [3], "load"))
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=r"2 transfers still in flight after 0.2 s: \[7, 8\]") as err:
        engine.drain(timeout=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0
    assert err.value.pending == (7, 8)
    assert engine.num_in_flight == 2 and engine.mirror_nbytes == 4 * SPEC.bytes_per_block
    engine.check_invariants()
    gate.set()
    assert [(r.transfer_id, r.ok) for r in engine.drain()] == [(7, True), (8, True)]
    assert [engine.read_block("cpu", 2), engine.read_block("cpu", 3), engine.read_block("gpu", 3)] == want
    engine.check_invariants()


def test_a_zero_timeout_polls_once(gates):
    """timeout=0 reports what already finished, or raises at once."""
    engine, backend, gate = _engine(gates)
    backend.gate = None
    engine.submit(1, TransferPlan([0], [0], "store"))
    assert backend.landed(0, timeout=5)
    assert [r.transfer_id for r in engine.drain(timeout=0)] == [1]
    backend.gate = gate
    engine.submit(2, TransferPlan([1], [1], "store"))
    with pytest.raises(TransferTimeoutError, match=r"\[2\]"):
        engine.drain(timeout=0)


def test_results_a_timed_out_drain_collected_are_reported_later(gates):
    """A transfer that finished during a drain that timed out is reported by the next poll, once."""
    engine, backend, gate = _engine(gates)
    backend.gate = None
    engine.submit(1, TransferPlan([0], [0], "store"))
    backend.gate = gate
    engine.submit(2, TransferPlan([1], [1], "store"))
    with pytest.raises(TransferTimeoutError) as err:
        engine.drain(timeout=0.1)
    assert err.value.pending == (2,) and engine.num_in_flight == 2
    engine.check_invariants()
    assert [(r.transfer_id, r.ok) for r in engine.poll()] == [(1, True)]
    gate.set()
    assert [r.transfer_id for r in engine.drain()] == [2]


def test_the_default_bound_comes_from_the_engine_and_the_stack(gates):
    """drain() without a timeout waits wait_timeout_s; build passes the slot on to every worker."""
    assert TransferEngine(SPEC, ThreadedCopy(), num_cpu_blocks=1).wait_timeout_s == WAIT_TIMEOUT_S
    engine, _, _ = _engine(gates, wait_timeout_s=0.1)
    engine.submit(1, TransferPlan([0], [0], "store"))
    start = time.monotonic()
    with pytest.raises(TransferTimeoutError, match=r"after 0.1 s"):
        engine.drain()
    assert time.monotonic() - start < 1.0
    stack = kvkit.build(kv=SPEC, gpu_blocks=4, cpu_blocks=4, layout="per-layer", device="cpu",
                        wait_timeout_s=0.25, world_size=2)
    assert [w.wait_timeout_s for w in stack.workers] == [0.25, 0.25]
    assert kvkit.build(kv=SPEC, gpu_blocks=4, cpu_blocks=4, layout="per-layer", device="cpu",
                       wait_timeout_s=math.inf).workers[0].wait_timeout_s == math.inf


def test_close_that_times_out_releases_nothing(gates):
    """close() on a running copy raises and keeps the mirror, the regions and the registration; later it closes."""
    engine, _, gate = _engine(gates)
    engine.submit(5, TransferPlan([0], [1], "store"))
    mirror, regions = engine.cpu_kv, engine.regions
    with pytest.raises(TransferTimeoutError, match=r"\[5\]"):
        engine.close(timeout=0.1)
    assert engine.layout == "per-layer" and engine.mirror_nbytes == 4 * SPEC.bytes_per_block
    assert all(a is b for a, b in zip(engine.cpu_kv, mirror, strict=True)) and len(engine.regions) == len(regions)
    engine.check_invariants()
    gate.set()
    assert [(r.transfer_id, r.ok) for r in engine.close()] == [(5, True)]
    assert engine.layout is None and engine.mirror_nbytes == 0 and engine.num_in_flight == 0
    engine.check_invariants()


def test_stack_close_times_out_then_closes_and_applies_the_results(gates):
    """A stack whose store never completes refuses to close, unchanged; released, it closes cleanly."""
    backend = ThreadedCopy()
    stack = kvkit.build(kv=SPEC, gpu_blocks=8, cpu_blocks=8, layout="per-layer", copy=backend, device="cpu")
    engine = ReferenceEngine(stack)
    gates.append(backend.hold())
    tokens = list(range(13))
    engine.add_request("a", hash_blocks(tokens, SPEC.block_size), len(tokens))
    engine.step()
    engine.finish("a")
    engine.step()
    in_flight = stack.manager.num_in_flight
    assert in_flight > 0
    with pytest.raises(TransferTimeoutError, match="still in flight") as err:
        stack.close(timeout=0.1)
    assert err.value.pending and stack.manager.num_in_flight == in_flight
    stack.check_invariants()
    gates[-1].set()
    stack.close()
    assert stack.manager.num_in_flight == 0 and stack.workers[0].layout is None
    stack.manager.check_invariants()


@pytest.mark.parametrize("timeout", [-1, math.nan, "1", True, [1]])
def test_bad_timeouts_are_refused_before_waiting(gates, timeout):
    """A timeout that is not a number >= 0 raises ConfigError quoting it; nothing changes and a valid drain works."""
    engine, _, gate = _engine(gates)
    engine.submit(1, TransferPlan([0], [0], "store"))
    for call in (engine.drain, engine.close):
        with pytest.raises(ConfigError, match=r"timeout=.*must be a number"):
            call(timeout=timeout)
    assert engine.num_in_flight == 1 and engine.layout == "per-layer"
    engine.check_invariants()
    gate.set()
    assert [r.transfer_id for r in engine.drain(timeout=5)] == [1]
