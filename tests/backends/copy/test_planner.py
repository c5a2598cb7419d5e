"""Tests for the copy planner: coalesced and strided descriptors move exactly the plain plan's bytes."""

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.copy.planner import Descriptors, Planner, runs
from kvkit.errors import PlanError, SpecMismatchError
from kvkit.interfaces import KVCacheSpec, Region, TransferPlan
from kvkit.testing.kvdata import (
    BAD_PLANS,
    TWO_GROUPS,
    fill_random,
    plans,
    reference_copy,
    spec_layouts,
    tensor_bytes,
)
from kvkit.worker.layouts import allocate_kv, kv_nbytes, kv_views, regions_for


def _caches(spec, layout, num_gpu, num_cpu, buffer):
    """Both tiers on the host, as separate tensors or carved from one buffer (evenly spaced regions)."""
    tiers = []
    for n in (num_gpu, num_cpu):
        if buffer:
            tiers.append(kv_views(spec, layout, n, torch.empty(kv_nbytes(spec, layout, n), dtype=torch.uint8)))
        else:
            tiers.append(allocate_kv(spec, layout, n))
    return tiers


def _byte_map(desc: Descriptors) -> np.ndarray:
    """Every (source address, destination address) byte pair the descriptors move, sorted."""
    size = desc.size.astype(np.int64)
    owner = np.repeat(np.arange(len(size)), size)
    offset = np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
    pairs = np.stack([desc.src.astype(np.int64)[owner] + offset, desc.dst.astype(np.int64)[owner] + offset], 1)
    return pairs[np.lexsort(pairs.T[::-1])]


def _execute(desc: Descriptors, tensors) -> None:
    """Run the descriptors on host memory, checking each stays inside one tensor."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    for s, d, n in zip(desc.src.tolist(), desc.dst.tolist(), desc.size.tolist(), strict=True):
        assert n > 0
        for a in (s, d):
            assert any(lo <= a and a + n <= hi for lo, hi in spans), (a, n)
        ctypes.memmove(d, s, n)


@st.composite
def _setups(draw):
    spec, layout = draw(spec_layouts())
    num_gpu, num_cpu = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    gpu, cpu = _caches(spec, layout, num_gpu, num_cpu, buffer=draw(st.booleans()))
    fill_random(gpu + cpu, draw(st.integers(0, 9)))
    regions = regions_for(spec, layout, gpu, cpu)
    plan = draw(plans(len(spec.groups), num_gpu, num_cpu))
    return regions, gpu + cpu, plan


@given(_setups())
def test_coalesced_plan_moves_the_same_bytes_as_the_plain_one(setup):
    """Coalescing runs changes the descriptors, never the byte-to-byte mapping they move."""
    regions, _, plan = setup
    planner = Planner.of(regions)
    planner.validate(plan)
    coalesced, plain = planner.descriptors(plan), planner.descriptors(plan, coalesce=False)
    assert len(coalesced) <= len(plain)
    assert (len(coalesced), coalesced.nbytes) == planner.count(plan)
    assert (len(plain), plain.nbytes) == planner.count(plan, coalesce=False)
    assert np.array_equal(_byte_map(coalesced), _byte_map(plain))


@given(_setups())
def test_strided_copies_move_the_same_bytes(setup):
    """2-D copies across evenly spaced regions map exactly the plain plan's bytes."""
    regions, _, plan = setup
    planner = Planner.of(regions)
    strided = planner.strided(plan)
    if strided is not None:
        plain = _byte_map(planner.descriptors(plan, coalesce=False))
        assert np.array_equal(_byte_map(strided.flatten()), plain)
        assert strided.nbytes == len(plan) * sum(r.piece_bytes for r in regions if r.group == plan.group)


@given(_setups())
def test_descriptors_executed_on_host_match_the_reference_copy(setup):
    """Running the coalesced descriptors byte by byte writes the reference's result and nothing else."""
    regions, tensors, plan = setup
    views = [v for r in regions for v in (r.gpu, r.cpu)]  # reference_copy names regions' views; they cover every byte
    before = {id(v): tensor_bytes(v) for v in views}
    expected = {id(dst): tensor_bytes(want) for dst, want in reference_copy(regions, plan)}
    planner = Planner.of(regions)
    planner.validate(plan)
    _execute(planner.descriptors(plan), tensors)
    for v in views:
        assert torch.equal(tensor_bytes(v), expected.get(id(v), before[id(v)]))


@pytest.mark.parametrize("layout", ["per-layer", "blocks-first", "cross-layer"])
@pytest.mark.parametrize("buffer", [False, True])
def test_consecutive_ids_coalesce_to_one_descriptor_per_region(layout, buffer):
    """A run of consecutive blocks is one descriptor per region in every layout."""
    spec = KVCacheSpec(num_layers=3, block_size=2, num_kv_heads=2, head_dim=8)
    gpu, cpu = _caches(spec, layout, 16, 12, buffer)
    regions = regions_for(spec, layout, gpu, cpu)
    planner = Planner.of(regions)
    plan = TransferPlan(np.arange(3, 11), np.arange(1, 9), "store")
    desc = planner.descriptors(plan)
    assert len(desc) == len(regions)
    assert desc.nbytes == 8 * spec.bytes_per_block
    strided = planner.strided(plan)
    if buffer and len(regions) > 1:
        assert strided is not None and len(strided) == 1 and strided.height == len(regions)
    elif len(regions) == 1:
        assert strided is None
    # Separate tensors form a 2-D copy only if the allocator happened to space them evenly.


def test_per_layer_regions_carved_from_one_buffer_are_evenly_spaced():
    """K/V halves of every layer, carved back to back, form one 2-D copy per block."""
    spec = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128)
    gpu, cpu = _caches(spec, "per-layer", 8, 10, buffer=True)
    planner = Planner.of(regions_for(spec, "per-layer", gpu, cpu))
    strided = planner.strided(TransferPlan([1, 5, 2], [0, 9, 4], "load"))
    assert strided is not None
    assert (len(strided), strided.height) == (3, 8)
    assert (strided.src_pitch, strided.dst_pitch) == (10 * 32768, 8 * 32768)  # CPU to GPU
    assert strided.width.tolist() == [32768] * 3


@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30))
def test_runs_are_maximal_runs_of_both_ids_stepping_by_one(a, b):
    """``runs`` splits exactly where either id sequence does not step by +1."""
    n = min(len(a), len(b))
    src, dst = np.cumsum(a[:n], dtype=np.int64), np.cumsum(b[:n], dtype=np.int64)
    starts, lengths = runs(src, dst)
    expected = [i for i in range(n) if i == 0 or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1]
    assert starts.tolist() == expected
    assert lengths.sum() == n and (lengths > 0).all()


SPEC = TWO_GROUPS


@pytest.mark.parametrize(("plan", "pattern"), BAD_PLANS)
def test_bad_plans_raise_plan_errors_quoting_the_values(plan, pattern):
    """Out-of-range ids, repeated destinations and unregistered groups are PlanErrors."""
    gpu, cpu = allocate_kv(SPEC, "per-layer", 4), allocate_kv(SPEC, "per-layer", 3)
    with pytest.raises(PlanError, match=pattern):
        Planner.of(regions_for(SPEC, "per-layer", gpu, cpu)).validate(plan)


@pytest.mark.parametrize("plan", [None, "store", {"src": [0], "dst": [0]}, (np.array([0]), np.array([0]))])
def test_a_plan_that_is_not_a_transfer_plan_is_a_plan_error(plan):
    """Anything but a TransferPlan is refused with a PlanError naming its type, never an AttributeError."""
    gpu, cpu = allocate_kv(SPEC, "per-layer", 4), allocate_kv(SPEC, "per-layer", 3)
    with pytest.raises(PlanError, match=f"plan must be a TransferPlan, got {type(plan).__name__}"):
        Planner.of(regions_for(SPEC, "per-layer", gpu, cpu)).validate(plan)


def test_duplicate_region_names_are_rejected():
    """Two regions with one name make descriptors ambiguous: SpecMismatchError."""
    t = torch.zeros(2, 4)
    with pytest.raises(SpecMismatchError, match="unique"):
        Planner.of([Region("a", t, t), Region("a", t, t)])


def test_empty_plan_has_no_descriptors():
    """An empty plan plans to nothing."""
    gpu, cpu = allocate_kv(SPEC, "per-layer", 4), allocate_kv(SPEC, "per-layer", 3)
    planner = Planner.of(regions_for(SPEC, "per-layer", gpu, cpu))
    plan = TransferPlan([], [], "store")
    planner.validate(plan)
    assert len(planner.descriptors(plan)) == 0 and planner.count(plan) == (0, 0)
