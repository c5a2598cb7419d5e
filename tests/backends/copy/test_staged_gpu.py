"""GPU tests of the staged backend: whole CPU blocks through GPU staging slots."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkit.errors import SpecMismatchError
from kvkit.interfaces import CopyBackend, KVCacheSpec
from kvkit.registry import COPY
from kvkit.testing.kvdata import fill_random, kv_specs, plans, tensor_bytes
from kvkit.worker.layouts import allocate_kv, kv_nbytes, kv_views, regions_for

pytestmark = pytest.mark.gpu


def _pinned(spec, layout, num_blocks):
    buf = torch.empty(kv_nbytes(spec, layout, num_blocks), dtype=torch.uint8, pin_memory=True)
    return kv_views(spec, layout, num_blocks, buf)


def _tiers(spec, layout, cpu_layout, num_gpu, num_cpu, seed):
    gpu, cpu = allocate_kv(spec, layout, num_gpu, "cuda"), _pinned(spec, cpu_layout, num_cpu)
    fill_random(gpu + cpu, seed)
    return gpu, cpu


@settings(max_examples=20)
@given(data=st.data(), spec=kv_specs().filter(lambda s: len(s.groups) == 1),
       layout=st.sampled_from(["per-layer", "blocks-first", "cross-layer"]),
       num_gpu=st.integers(1, 8), num_cpu=st.integers(1, 8),
       chunk_blocks=st.integers(1, 3), slots=st.integers(1, 3))
def test_staged_agrees_with_torch_byte_for_byte(data, spec, layout, num_gpu, num_cpu, chunk_blocks, slots):
    """On random plans longer than its slots, staged leaves both tiers exactly as the torch backend does."""
    gpu, cpu = _tiers(spec, layout, "cross-layer", num_gpu, num_cpu, data.draw(st.integers(0, 99)))
    ref_gpu, ref_cpu = [t.clone() for t in gpu], [t.clone() for t in cpu]
    backend = COPY.create("staged", chunk_blocks=chunk_blocks, slots=slots, sm_budget=1)
    reference = COPY.create("torch")
    assert isinstance(backend, CopyBackend)
    backend.register(regions_for(spec, layout, gpu, cpu, cpu_layout="cross-layer"))
    reference.register(regions_for(spec, layout, ref_gpu, ref_cpu, cpu_layout="cross-layer"))
    plan_list = data.draw(st.lists(plans(1, num_gpu, num_cpu), min_size=1, max_size=5))
    handles = [backend.submit(p) for p in plan_list]
    for p in plan_list:
        reference.wait(reference.submit(p))
    backend.wait(handles[-1])
    for mine, theirs in zip(gpu + cpu, ref_gpu + ref_cpu, strict=True):
        assert torch.equal(tensor_bytes(mine), tensor_bytes(theirs)), (layout, plan_list)
    assert backend.poll() == handles
    backend.check_invariants()


def test_a_cpu_tier_without_whole_blocks_is_refused():
    """Per-layer CPU pieces (a block's pieces far apart) are a SpecMismatchError naming the fix."""
    spec = KVCacheSpec(num_layers=2, block_size=2, num_kv_heads=1, head_dim=8, dtype="float16")
    gpu, cpu = _tiers(spec, "per-layer", "per-layer", 4, 3, seed=6)
    with pytest.raises(SpecMismatchError, match="cpu_layout='cross-layer'"):
        COPY.create("staged").register(regions_for(spec, "per-layer", gpu, cpu))


def test_pageable_cpu_or_host_gpu_tiers_are_refused():
    """A CPU tier that is not page-locked, or a GPU tier in host memory, is refused at register."""
    spec = KVCacheSpec(num_layers=2, block_size=2, num_kv_heads=1, head_dim=8, dtype="float16")
    backend = COPY.create("staged")
    gpu = allocate_kv(spec, "per-layer", 4, "cuda")
    with pytest.raises(SpecMismatchError, match="page-locked"):
        backend.register(regions_for(spec, "per-layer", gpu, allocate_kv(spec, "cross-layer", 3),
                                     cpu_layout="cross-layer"))
    with pytest.raises(SpecMismatchError, match="CUDA device"):
        backend.register(regions_for(spec, "per-layer", allocate_kv(spec, "per-layer", 4),
                                     _pinned(spec, "cross-layer", 3), cpu_layout="cross-layer"))
