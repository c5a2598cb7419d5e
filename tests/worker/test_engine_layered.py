"""Layered transfers on the host: stage bookkeeping, whole-plan reports, and waits that cover every load."""

import threading
import warnings

import pytest
import torch

from kvkit.backends.copy import TorchCopy
from kvkit.errors import ConfigError, TransferTimeoutError
from kvkit.interfaces import KVCacheSpec, KVGroupSpec, TransferPlan
from kvkit.testing import ThreadedCopy
from kvkit.testing.kvdata import fill_random, tensor_bytes
from kvkit.worker.engine import TransferEngine, layer_stages

SPEC = KVCacheSpec(num_layers=4, block_size=2, num_kv_heads=1, head_dim=4, dtype="float16")
HYBRID = KVCacheSpec(num_layers=4, block_size=2, num_kv_heads=1, head_dim=4, dtype="float16",
                     groups=[KVGroupSpec([0, 2]), KVGroupSpec([1, 3], kind="sliding_window", window=4)])


def _engine(copy, spec=SPEC, layout="per-layer", cpu_layout=None, layers_per_stage=1):
    engine = TransferEngine(spec, copy, num_cpu_blocks=4, layers_per_stage=layers_per_stage)
    fill_random(engine.allocate_kv(5, layout, cpu_layout=cpu_layout), seed=3)
    fill_random(engine.cpu_kv, seed=4)
    return engine


@pytest.mark.parametrize(("layout", "cpu_layout", "per_stage", "expected"), [
    ("per-layer", None, 1, [(range(2), (0,)), (range(2, 4), (1,)), (range(4, 6), (2,)), (range(6, 8), (3,))]),
    ("blocks-first", None, 1, [(range(i, i + 1), (i,)) for i in range(4)]),
    ("per-layer", "cross-layer", 2, [(range(4), (0, 1)), (range(4, 8), (2, 3))]),
    ("blocks-first", None, 3, [(range(3), (0, 1, 2)), (range(3, 4), (3,))]),
    ("cross-layer", None, 1, [(range(1), (0, 1, 2, 3))]),  # one piece holds every layer: no pipelining
])
def test_stages_follow_layers_in_region_order(layout, cpu_layout, per_stage, expected):
    """A stage holds ``layers_per_stage`` whole layers (K and V together); a cross-layer piece is one stage."""
    engine = _engine(TorchCopy(), layout=layout, cpu_layout=cpu_layout)
    assert layer_stages(SPEC, engine.regions, per_stage) == {0: expected}


def test_each_group_has_its_own_stages():
    """Layers of a hybrid model's groups are staged per group, in that group's region order."""
    engine = _engine(TorchCopy(), spec=HYBRID)
    assert layer_stages(HYBRID, engine.regions, 1) == {
        0: [(range(2), (0,)), (range(2, 4), (2,))], 1: [(range(2), (1,)), (range(2, 4), (3,))]}


@pytest.mark.parametrize("direction", ["load", "store"])
def test_a_layered_transfer_copies_the_plan_and_reports_once(direction):
    """Layered or not, the bytes end the same and the transfer is reported once, whole."""
    whole, layered = _engine(TorchCopy()), _engine(TorchCopy())
    plan = TransferPlan([0, 2], [3, 1], direction)
    whole.submit(7, plan)
    layered.submit(7, plan, layered=True, written={0: None, 1: None})
    for layer in range(SPEC.num_layers):
        layered.wait_layer(layer)
    results = layered.drain()
    assert [(r.transfer_id, r.ok, r.num_bytes) for r in results] == [(7, True, 2 * SPEC.bytes_per_block)]
    whole.drain()
    for a, b in zip(whole.gpu_kv + whole.cpu_kv, layered.gpu_kv + layered.cpu_kv, strict=True):
        assert torch.equal(tensor_bytes(a), tensor_bytes(b))


def test_wait_layer_waits_for_a_load_the_backend_cannot_stage():
    """A backend without stages (threads here) is waited for whole: the layer reads only landed bytes."""
    copy = ThreadedCopy(threads=1)
    engine = _engine(copy)
    gate = copy.hold()
    engine.submit(1, TransferPlan([0], [4], "load"), layered=True)
    with pytest.raises(TransferTimeoutError, match=r"\[1\]"):
        engine.wait_layer(0, timeout=0.05)  # the copy is held: the wait must not return early
    threading.Timer(0.05, gate.set).start()
    engine.wait_layer(2)
    assert torch.equal(tensor_bytes(engine.block_pieces("gpu", 4)[4]), tensor_bytes(engine.block_pieces("cpu", 0)[4]))
    assert [r.transfer_id for r in engine.poll()] == [1]  # the wait left the result for poll


def test_wait_layer_ignores_stores():
    """Only loads write the GPU tier: a held store does not make a layer wait."""
    copy = ThreadedCopy(threads=1)
    engine = _engine(copy)
    gate = copy.hold()
    engine.submit(1, TransferPlan([0], [0], "store"))
    engine.wait_layer(0, timeout=0.01)
    gate.set()
    assert [r.ok for r in engine.drain()] == [True]


@pytest.mark.parametrize("layer", [-1, 4, 1.5, "0"])
def test_wait_layer_refuses_a_layer_outside_the_spec(layer):
    """A layer that is not an int in 0..num_layers-1 is refused, quoted."""
    with pytest.raises(ConfigError, match="layer"):
        _engine(TorchCopy()).wait_layer(layer)


def test_layers_per_stage_is_checked():
    """``layers_per_stage`` must be an int >= 1."""
    with pytest.raises(ConfigError, match="layers_per_stage"):
        TransferEngine(SPEC, TorchCopy(), num_cpu_blocks=2, layers_per_stage=0)


def test_wait_layer_can_be_limited_to_some_transfers():
    """A held load outside ``transfers`` does not hold the wait up; one inside it does."""
    copy = ThreadedCopy(threads=1)
    engine = _engine(copy)
    gate = copy.hold()
    engine.submit(1, TransferPlan([0], [4], "load"), layered=True)
    engine.wait_layer(0, timeout=0.01, transfers={2})
    with pytest.raises(TransferTimeoutError):
        engine.wait_layer(0, timeout=0.01, transfers={1})
    gate.set()
    engine.drain()


class _AnswersStages(ThreadedCopy):
    """A layered backend that copies the plan whole on its threads and answers ``answer(stages)`` as its events."""

    def __init__(self, answer):
        super().__init__(threads=1)
        self._answer = answer

    def submit_stages(self, plan, stages, *, after=None):
        return self.submit(plan), self._answer(stages)


@pytest.mark.parametrize(("answer", "warns"), [
    (lambda stages: [() for _ in stages], False),  # claims every stage landed while the copy is held
    (lambda stages: [], True),                     # no tuple per stage: breaks the contract
    (lambda stages: None, True),
])
def test_a_layered_load_without_stage_events_is_waited_for_whole(answer, warns):
    """A stage's events are trusted only when every stage answered some; else wait_layer waits for the load whole."""
    copy = _AnswersStages(answer)
    engine = _engine(copy)
    gate = copy.hold()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.submit(1, TransferPlan([0], [4], "load"), layered=True)
    assert any("not one tuple of events per stage" in str(w.message) for w in caught) == warns
    with pytest.raises(TransferTimeoutError, match=r"\[1\]"):
        engine.wait_layer(0, timeout=0.05)  # the copy is held: layer 0 is not readable yet
    gate.set()
    engine.wait_layer(0)
    assert torch.equal(tensor_bytes(engine.block_pieces("gpu", 4)[0]), tensor_bytes(engine.block_pieces("cpu", 0)[0]))
    assert [(r.transfer_id, r.ok) for r in engine.drain()] == [(1, True)]
