"""CPU-side tests of the GPU copy backends: lazy imports, availability, driver ABI, auto's routing."""

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.copy import TorchCopy
from kvkit.backends.copy._driver import ATTRS_DTYPE, BATCH_OP_DTYPE
from kvkit.backends.copy.auto import AutoCopy
from kvkit.errors import BackendUnavailableError, ConfigError, PlanError
from kvkit.interfaces import CopyBackend, Direction, KVCacheSpec, TransferPlan
from kvkit.registry import COPY
from kvkit.testing.kvdata import fill_random, plans, reference_copy, spec_layouts, tensor_bytes
from kvkit.worker.layouts import allocate_kv, regions_for

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_importing_backends_loads_neither_cupy_nor_the_driver():
    """Importing kvkit and the GPU backend modules imports no CuPy and opens no libcuda."""
    code = ("import sys, kvkit, kvkit.backends.copy.cuda_dma, kvkit.backends.copy.cupy_batch, "
            "kvkit.backends.copy.auto, kvkit.backends.copy.staged\n"
            "from kvkit.backends.copy import _driver\n"
            "assert 'cupy' not in sys.modules, 'cupy imported'\n"
            "assert _driver.driver.cache_info().currsize == 0, 'driver loaded'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_no_cuda
@pytest.mark.parametrize("name", ["cuda-dma", "cupy-batch", "auto", "staged"])
def test_gpu_backends_are_cleanly_unavailable_without_a_gpu(name):
    """On a CPU-only machine the GPU backends report unavailable and refuse to build, typed."""
    assert not COPY.load(name).is_available()
    assert COPY.why_unavailable(name) is not None
    with pytest.raises(BackendUnavailableError):
        COPY.load(name)()


@pytest.mark.parametrize("options", [{"sm_budget": 0}, {"threads": 48}, {"threads": 2048}, {"unroll": -1},
                                     {"method": "tma"}, {"stage_bytes": 100}, {"stages": 40}])
def test_cupy_batch_rejects_bad_settings(options):
    """Out-of-range kernel settings are ConfigErrors quoting the value, on any machine."""
    from kvkit.backends.copy.cupy_batch import CupyBatchCopy

    with pytest.raises(ConfigError, match=repr(next(iter(options.values())))):
        CupyBatchCopy(**options)


@pytest.mark.parametrize("options", [{"chunk_blocks": 0}, {"slots": -1}, {"sm_budget": 0}, {"slots": 1.5},
                                     {"chunk_blocks": True}])
def test_staged_rejects_bad_settings(options):
    """Staging settings that are not positive ints are ConfigErrors quoting the value, on any machine."""
    from kvkit.backends.copy.staged import StagedCopy

    with pytest.raises(ConfigError, match=repr(next(iter(options.values())))):
        StagedCopy(**options)


def test_driver_records_match_the_cuda_headers():
    """The numpy records handed to the driver have CUDA 12.8/13's field offsets and sizes."""
    assert ATTRS_DTYPE.itemsize == 24
    assert [ATTRS_DTYPE.fields[f][1] for f in ("order", "src_loc", "dst_loc", "flags")] == [0, 4, 12, 20]
    assert BATCH_OP_DTYPE.itemsize == 112
    assert [BATCH_OP_DTYPE.fields[f][1] for f in ("src", "dst", "width", "order", "flags")] == [0, 40, 80, 104, 108]
    operand = BATCH_OP_DTYPE.fields["src"][0]
    assert [operand.fields[f][1] for f in ("type", "ptr", "row", "layer", "loc")] == [0, 8, 16, 24, 32]


def _auto_on_host(share, small_loads="kernel"):
    """AutoCopy routing between two host-memory backends standing in for the engines and the kernel."""
    return AutoCopy(dma=TorchCopy(), kernel=TorchCopy(), kernel_share=share, dma_min_bytes=1 << 40,
                    small_loads=small_loads)


@given(st.data(), spec_layouts(), st.integers(1, 6), st.integers(1, 6), st.sampled_from([0.0, 0.3, 0.7]),
       st.sampled_from(["dma", "kernel"]))
def test_auto_moves_exactly_the_reference_bytes(data, spec_layout, num_gpu, num_cpu, share, small_loads):
    """Routed or split between two backends, every plan writes the reference's bytes, handles in order."""
    spec, layout = spec_layout
    gpu, cpu = allocate_kv(spec, layout, num_gpu), allocate_kv(spec, layout, num_cpu)
    fill_random(gpu + cpu, data.draw(st.integers(0, 9)))
    regions = regions_for(spec, layout, gpu, cpu)
    auto = _auto_on_host(share, small_loads)
    assert isinstance(auto, CopyBackend)
    auto.register(regions)
    plan_list = data.draw(st.lists(plans(len(spec.groups), num_gpu, num_cpu), min_size=1, max_size=3))
    views = [v for r in regions for v in (r.gpu, r.cpu)]  # reference_copy names regions' views; they cover every byte
    for plan in plan_list:
        before = {id(v): tensor_bytes(v) for v in views}
        expected = {id(dst): tensor_bytes(want) for dst, want in reference_copy(regions, plan)}
        if not len(plan) or (plan.direction is Direction.LOAD and small_loads == "dma"):
            want = "dma"
        else:
            want = "split" if share and len(plan) > 1 else "kernel"
        assert auto.choose(plan) == want
        auto.submit(plan)
        for v in views:
            assert torch.equal(tensor_bytes(v), expected.get(id(v), before[id(v)]))
    auto.wait(len(plan_list) - 1)
    assert auto.poll() == list(range(len(plan_list)))
    auto.check_invariants()


def test_auto_answers_the_longest_of_its_parts_own_times():
    """A split plan's handle is timed by its slower part, as its inner backends timed them; a handle waited for
    before its parts were polled is untimed, and nothing of it is kept."""
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128)
    gpu, cpu = allocate_kv(spec, "per-layer", 64), allocate_kv(spec, "per-layer", 64)
    auto = _auto_on_host(0.5)
    auto.register(regions_for(spec, "per-layer", gpu, cpu))
    handle = auto.submit(TransferPlan(np.arange(32), np.arange(32), "store"))
    for backend, seconds in ((auto.dma, 0.002), (auto.kernel, 0.005)):  # the inner copies' own times
        backend.copy_seconds = lambda h, s=seconds: s
    assert auto.poll() == [handle] and auto.copy_seconds(handle) == 0.005
    assert auto.poll() == [] and auto.copy_seconds(handle) is None
    later = auto.submit(TransferPlan(np.arange(32), np.arange(32) + 32, "store"))
    auto.wait(later)
    assert auto.poll() == [later] and auto.copy_seconds(later) is None
    assert auto._timed == {}
    auto.check_invariants()


def test_auto_routes_large_pieces_to_the_engines():
    """Mean bytes per engine operation at or above dma_min_bytes send a plan to the engines."""
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128)
    gpu, cpu = allocate_kv(spec, "per-layer", 64), allocate_kv(spec, "per-layer", 64)
    auto = AutoCopy(dma=TorchCopy(), kernel=TorchCopy(), dma_min_bytes=64 << 10, strided=False)
    auto.register(regions_for(spec, "per-layer", gpu, cpu))
    assert auto.choose(TransferPlan([1, 7, 3], [2, 9, 4], "store")) == "kernel"  # 32 KiB pieces
    assert auto.choose(TransferPlan(np.arange(8), np.arange(8) + 8, "store")) == "dma"  # 256 KiB runs


def test_auto_validates_the_whole_plan_before_launching_a_part():
    """A bad plan raises PlanError and neither inner backend launches anything."""
    spec = KVCacheSpec(num_layers=1, block_size=2, num_kv_heads=1, head_dim=4)
    gpu, cpu = allocate_kv(spec, "per-layer", 4), allocate_kv(spec, "per-layer", 4)
    auto = _auto_on_host(0.5)
    with pytest.raises(PlanError, match="register"):
        auto.submit(TransferPlan([0], [0], "store"))
    auto.register(regions_for(spec, "per-layer", gpu, cpu))
    with pytest.raises(PlanError, match=r"out of range \[0, 4\) in group 0: \[9\]"):
        auto.submit(TransferPlan([0, 1, 9], [0, 1, 2], "store"))
    assert auto.poll() == [] and auto.dma.poll() == [] and auto.kernel.poll() == []


@pytest.mark.parametrize("options", [{"kernel_share": 1.5}, {"small_loads": "cpu"}])
def test_auto_rejects_bad_settings(options):
    """kernel_share outside [0, 1) and unknown small_loads targets are ConfigErrors."""
    with pytest.raises(ConfigError, match=repr(next(iter(options.values())))):
        AutoCopy(dma=TorchCopy(), **options)
