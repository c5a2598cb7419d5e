"""``ThreadedCopy``: copies on a host thread pool that land late on demand, and a poll that fails on demand."""

import threading
import time

import pytest
import torch

from kvkit.errors import ConfigError, PlanError
from kvkit.interfaces import KVCacheSpec, TransferPlan
from kvkit.testing import ThreadedCopy
from kvkit.testing.kvdata import fill_random, tensor_bytes
from kvkit.worker.layouts import allocate_kv, regions_for

SPEC = KVCacheSpec(num_layers=2, block_size=2, num_kv_heads=1, head_dim=4, dtype="float16")


@pytest.fixture
def backend():
    """A registered ThreadedCopy on random tiers of 4 blocks; any gate it holds opens at teardown."""
    b = ThreadedCopy()
    gpu, cpu = allocate_kv(SPEC, "per-layer", 4), allocate_kv(SPEC, "per-layer", 4)
    fill_random(gpu + cpu, seed=3)
    b.register(regions_for(SPEC, "per-layer", gpu, cpu))
    b.tiers = gpu, cpu
    yield b
    if b.gate is not None:
        b.gate.set()


def _block(tensors, i):
    return [tensor_bytes(t[:, i]) for t in tensors]


def test_held_copies_land_when_released_and_are_reported_in_order(backend):
    """A held copy writes nothing until its gate opens; a later copy that lands first waits behind it in poll."""
    gpu, cpu = backend.tiers
    before = _block(cpu, 0)
    gate = backend.hold()
    assert backend.submit(TransferPlan([1], [0], "store")) == 0
    backend.gate = None
    assert backend.submit(TransferPlan([2], [1], "store")) == 1
    assert backend.landed(1, timeout=5) and not backend.landed(0)
    assert backend.poll() == [] and all(torch.equal(a, b) for a, b in zip(_block(cpu, 0), before, strict=True))
    gate.set()
    backend.wait(1)
    assert backend.poll() == [0, 1] and backend.poll() == []
    assert all(torch.equal(a, b) for a, b in zip(_block(cpu, 0), _block(gpu, 1), strict=True))
    assert backend.log == [("submit", 0), ("submit", 1), ("land", 1), ("land", 0)]
    backend.check_invariants()


def test_a_failing_poll_raises_while_copies_keep_running(backend):
    """poll_error makes poll and wait raise; the copy lands meanwhile and is reported once the error is cleared."""
    backend.poll_error = RuntimeError("device lost")
    backend.submit(TransferPlan([0], [0], "load"))
    for call in (backend.poll, lambda: backend.wait(0)):
        with pytest.raises(RuntimeError, match="device lost"):
            call()
    assert backend.landed(0, timeout=5)
    backend.poll_error = None
    assert backend.poll() == [0]


def test_a_forgotten_gate_opens_by_itself_after_max_hold_s(backend):
    """max_hold_s bounds a hold, so no pool thread outlives its test by more."""
    backend.max_hold_s = 0.05
    backend.hold()
    start = time.monotonic()
    backend.submit(TransferPlan([0], [1], "load"))
    backend.wait(0)
    assert 0.04 <= time.monotonic() - start < 5


def test_refusals():
    """Bad settings, plans before register, bad plans and unknown handles are typed errors; nothing is issued."""
    with pytest.raises(ConfigError, match=r"ThreadedCopy.threads=0"):
        ThreadedCopy(threads=0)
    b = ThreadedCopy()
    with pytest.raises(PlanError, match="register"):
        b.submit(TransferPlan([0], [0], "store"))
    with pytest.raises(PlanError, match="unknown copy handle 0"):
        b.wait(0)
    assert b.poll() == [] and b.plans == [] and isinstance(b.hold(), threading.Event)
