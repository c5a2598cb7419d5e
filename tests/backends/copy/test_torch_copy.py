"""Tests for the torch copy backend: exact bytes, plan validation, handle order."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.copy import TorchCopy
from kvkit.errors import PlanError, SpecMismatchError
from kvkit.interfaces import CopyBackend, Region, TransferPlan
from kvkit.testing.kvdata import (
    BAD_PLANS,
    TWO_GROUPS,
    fill_random,
    plans,
    reference_copy,
    spec_layouts,
    tensor_bytes,
)
from kvkit.worker.layouts import LAYOUTS, allocate_kv, regions_for


def _setup(spec, layout, num_gpu, num_cpu, device="cpu", seed=0):
    gpu, cpu = allocate_kv(spec, layout, num_gpu, device), allocate_kv(spec, layout, num_cpu)
    fill_random(gpu + cpu, seed)
    regions = regions_for(spec, layout, gpu, cpu)
    backend = TorchCopy()
    backend.register(regions)
    return backend, regions, gpu + cpu


def _snapshot(tensors):
    return [tensor_bytes(t) for t in tensors]


def _check_plan_copies_exactly(data, spec_layout, num_gpu, num_cpu, device):
    spec, layout = spec_layout
    backend, regions, _ = _setup(spec, layout, num_gpu, num_cpu, device, data.draw(st.integers(0, 9)))
    plan_list = data.draw(st.lists(plans(len(spec.groups), num_gpu, num_cpu), min_size=1, max_size=3))
    views = [v for r in regions for v in (r.gpu, r.cpu)]  # together they cover every tensor
    for plan in plan_list:
        before = {id(v): tensor_bytes(v) for v in views}
        expected = {id(dst): tensor_bytes(want) for dst, want in reference_copy(regions, plan)}
        handle = backend.submit(plan)
        backend.wait(handle)
        for v in views:  # written views match the reference; every other view is untouched
            assert torch.equal(tensor_bytes(v), expected.get(id(v), before[id(v)])), (plan, layout)
    assert backend.poll() == list(range(len(plan_list)))
    backend.check_invariants()


@given(st.data(), spec_layouts(), st.integers(1, 6), st.integers(1, 6))
def test_random_plans_move_exactly_the_right_bytes(data, spec_layout, num_gpu, num_cpu):
    """Every plan writes the reference's bytes to its destinations and nothing elsewhere."""
    _check_plan_copies_exactly(data, spec_layout, num_gpu, num_cpu, "cpu")


@pytest.mark.gpu
@given(st.data(), spec_layouts(), st.integers(1, 6), st.integers(1, 6))
def test_random_plans_move_exactly_the_right_bytes_cuda(data, spec_layout, num_gpu, num_cpu):
    """With the GPU tier on CUDA, plans still write exactly the reference's bytes."""
    _check_plan_copies_exactly(data, spec_layout, num_gpu, num_cpu, "cuda")


SPEC = TWO_GROUPS


@pytest.mark.parametrize(("plan", "pattern"), BAD_PLANS)
@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay != "cross-layer"])
def test_bad_plan_raises_before_writing(plan, pattern, layout):
    """A bad plan raises PlanError quoting the bad ids, and no tensor changes."""
    backend, _, tensors = _setup(SPEC, layout, num_gpu=4, num_cpu=3)
    before = _snapshot(tensors)
    with pytest.raises(PlanError, match=pattern):
        backend.submit(plan)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(tensors), strict=True))
    assert backend.poll() == []


def test_group_limits_use_the_smallest_region():
    """Ids are checked against the smallest region of the plan's group."""
    t = torch.zeros(4, 2)
    backend = TorchCopy()
    backend.register([Region("a", t, torch.zeros(3, 2)), Region("b", torch.zeros(2, 2), torch.zeros(3, 2))])
    with pytest.raises(PlanError, match=r"GPU block ids out of range \[0, 2\)"):
        backend.submit(TransferPlan([2], [0], "store"))


def test_poll_reports_each_handle_once_in_order():
    """Handles come back from poll in submission order, each exactly once."""
    backend, _, _ = _setup(SPEC, "per-layer", 4, 4)
    handles = [backend.submit(TransferPlan([i], [i], "store", group=i % 2)) for i in range(4)]
    handles.append(backend.submit(TransferPlan([], [], "load")))
    assert handles == [0, 1, 2, 3, 4]
    assert backend.poll() == handles
    assert backend.poll() == []
    backend.wait(2)  # already done: returns at once, reports nothing new
    assert backend.poll() == []
    backend.check_invariants()


def test_wait_rejects_unknown_handle():
    """Waiting for a handle never issued is a PlanError quoting it."""
    backend, _, _ = _setup(SPEC, "per-layer", 2, 2)
    with pytest.raises(PlanError, match="unknown copy handle 0"):
        backend.wait(0)


def test_register_rejects_duplicate_names():
    """Two regions of one name are refused."""
    t = torch.zeros(2, 3)
    with pytest.raises(SpecMismatchError, match=r"unique, got \['x', 'x'\]"):
        TorchCopy().register([Region("x", t, t.clone()), Region("x", t, t.clone())])


def test_register_replaces_regions():
    """A second register replaces the first: old groups are gone."""
    backend, _, _ = _setup(SPEC, "per-layer", 2, 2)
    backend.register([Region("only", torch.zeros(2, 3), torch.zeros(2, 3), group=5)])
    with pytest.raises(PlanError, match=r"registered groups: \[5\]"):
        backend.submit(TransferPlan([0], [0], "store", group=0))


def test_protocol_and_availability():
    """TorchCopy implements CopyBackend and is always available."""
    assert isinstance(TorchCopy(), CopyBackend)
    assert TorchCopy.is_available()


def test_rows_use_widest_aligned_word():
    """Pieces move as int64 words when their size allows, bytes otherwise (same result)."""
    for width, dtype in ((8, torch.int64), (4, torch.int32), (3, torch.uint8)):
        t = torch.zeros(2, width, dtype=torch.uint8)
        backend = TorchCopy()
        backend.register([Region("r", t, torch.arange(2 * width, dtype=torch.uint8).view(2, width))])
        assert backend._rows[0][0].gpu.dtype == dtype
        backend.submit(TransferPlan(np.array([1]), np.array([0]), "load"))
        assert t[0].tolist() == list(range(width, 2 * width))


@pytest.mark.gpu
def test_cuda_copies_use_a_low_priority_side_stream():
    """On CUDA the backend copies on its own least-priority stream, not the default one."""
    backend, _, _ = _setup(SPEC, "per-layer", 4, 4, device="cuda")
    stream = backend.stream
    assert stream is not None and stream != torch.cuda.default_stream()
    assert stream.priority == torch.cuda.Stream.priority_range()[0]
    handle = backend.submit(TransferPlan([0, 3], [1, 2], "store"))
    backend.wait(handle)
    assert backend.poll() == [handle]
