"""GPU tests of the CUDA copy backends: byte-for-byte agreement with torch, store ordering, typed errors."""

import numpy as np
import pytest
import torch

from kvkit.errors import PlanError, SpecMismatchError
from kvkit.interfaces import Direction, KVCacheSpec, KVGroupSpec, TransferPlan
from kvkit.registry import COPY
from kvkit.testing import CopyBackendContract
from kvkit.testing.kvdata import fill_random
from kvkit.worker.layouts import allocate_kv, kv_nbytes, kv_views, regions_for

pytestmark = pytest.mark.gpu

BACKENDS = {
    "cuda-dma": lambda: COPY.create("cuda-dma"),
    "cuda-dma-2d": lambda: COPY.create("cuda-dma", strided=True, prefer_overlap=False),
    "cupy-batch": lambda: COPY.create("cupy-batch"),
    "cupy-batch-vector": lambda: COPY.create("cupy-batch", method="vector", sm_budget=3),
    "cupy-batch-tiny-vector": lambda: COPY.create("cupy-batch", method="vector", sm_budget=1, threads=64,
                                                  unroll=2, chunk_bytes=48),
    "cupy-batch-tiny-bulk": lambda: COPY.create("cupy-batch", method="bulk", sm_budget=2, threads=64, stages=2,
                                                stage_bytes=48),
    "auto": lambda: COPY.create("auto"),
    "auto-split": lambda: COPY.create("auto", kernel_share=0.5, dma_min_bytes=1 << 40, small_loads="kernel"),
}


def _pinned_cache(spec, layout, num_blocks):
    buf = torch.empty(kv_nbytes(spec, layout, num_blocks), dtype=torch.uint8, pin_memory=True)
    return kv_views(spec, layout, num_blocks, buf)


def _gpu_cache(spec, layout, num_blocks, buffer):
    if buffer:
        buf = torch.empty(kv_nbytes(spec, layout, num_blocks), dtype=torch.uint8, device="cuda")
        return kv_views(spec, layout, num_blocks, buf)
    return allocate_kv(spec, layout, num_blocks, "cuda")


def _setup(spec, layout, num_gpu, num_cpu, buffer, seed):
    gpu, cpu = _gpu_cache(spec, layout, num_gpu, buffer), _pinned_cache(spec, layout, num_cpu)
    fill_random(gpu + cpu, seed)
    return gpu, cpu


# Byte-for-byte agreement with torch and refused bad plans: the contract, for each non-default setting
# (test_contract.py joins the defaults).


def _contract(name: str) -> type:
    """A CUDA join of the copy backend contract for ``BACKENDS[name]``."""
    return type(f"TestContract[{name}]", (CopyBackendContract,),
                {"device": "cuda", "make_backend": lambda self: BACKENDS[name]()})


for _name in ("cuda-dma-2d", "cupy-batch-vector", "cupy-batch-tiny-vector", "cupy-batch-tiny-bulk", "auto-split"):
    globals()[f"TestContract_{_name.replace('-', '_')}"] = _contract(_name)


@pytest.mark.parametrize(("name", "layout", "cpu_layout"),
                         [(n, lay, lay) for n in sorted(BACKENDS) for lay in ("per-layer", "cross-layer")]
                         + [("staged", "per-layer", "cross-layer")])
def test_store_right_after_a_kernel_never_copies_stale_data(name, layout, cpu_layout):
    """A store ordered ``after`` the kernel writing its source copies the new bytes, not the old."""
    spec = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=8, head_dim=128)
    gpu, cpu = _gpu_cache(spec, layout, 64, buffer=True), _pinned_cache(spec, cpu_layout, 64)
    fill_random(gpu + cpu, 3)
    regions = regions_for(spec, layout, gpu, cpu, cpu_layout=cpu_layout)
    # staged: 2-block chunks through one slot, so the slot is reused within the plan
    backend = BACKENDS[name]() if name in BACKENDS else COPY.create(name, chunk_blocks=2, slots=1)
    backend.register(regions)
    src, dst = np.array([5, 9, 10, 11, 40]), np.array([1, 2, 3, 30, 7])
    compute = torch.cuda.Stream()
    for value in (7, 11):
        with torch.cuda.stream(compute):
            torch.cuda._sleep(20_000_000)  # keep the writer busy so a copy that does not wait reads old bytes
            for r in regions:
                r.gpu[torch.as_tensor(src, device="cuda")] = value
            written = torch.cuda.Event()
            written.record(compute)
        backend.wait(backend.submit(TransferPlan(src, dst, "store"), after=written))
        for r in regions:
            assert (r.cpu[torch.as_tensor(dst)] == value).all(), (name, r.name, value)


@pytest.mark.parametrize(("name", "cpu_layout"), [(n, "per-layer") for n in sorted(BACKENDS)]
                         + [("staged", "cross-layer")])
def test_stores_and_loads_at_once_complete_in_submission_order(name, cpu_layout):
    """Interleaved stores and loads (two streams) are reported once each, in order, with the right bytes."""
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128)
    gpu, cpu = _gpu_cache(spec, "per-layer", 128, buffer=False), _pinned_cache(spec, cpu_layout, 128)
    fill_random(gpu + cpu, 4)
    regions = regions_for(spec, "per-layer", gpu, cpu, cpu_layout=cpu_layout)
    backend = BACKENDS[name]() if name in BACKENDS else COPY.create(name, chunk_blocks=4, slots=2)
    backend.register(regions)
    rng = np.random.default_rng(0)
    g, c = rng.permutation(128), rng.permutation(128)
    plan_list = []
    for i in range(8):
        gs, cs = g[i * 16:(i + 1) * 16], c[i * 16:(i + 1) * 16]
        plan_list.append(TransferPlan(gs, cs, "store") if i % 2 == 0 else TransferPlan(cs, gs, "load"))
    expected = []
    for p in plan_list:
        for r in regions:
            src, dst = (r.gpu, r.cpu) if p.direction is Direction.STORE else (r.cpu, r.gpu)
            expected.append((dst, p.dst, src[torch.tensor(p.src, device=src.device)].cpu()))
    handles = [backend.submit(p) for p in plan_list]
    seen = []
    while len(seen) < len(handles):
        seen += backend.poll()
    assert seen == handles
    for dst, ids, want in expected:
        assert torch.equal(dst[torch.tensor(ids, device=dst.device)].cpu().view(torch.uint8),
                           want.view(torch.uint8))


SPEC = KVCacheSpec(num_layers=2, block_size=2, num_kv_heads=1, head_dim=8, dtype="float16",
                   groups=[KVGroupSpec([0]), KVGroupSpec([1])])


def test_mismatched_lengths_are_rejected_when_the_plan_is_made():
    """Source and destination of different lengths never reach a backend."""
    with pytest.raises(PlanError, match="differ in length: 2 != 1"):
        TransferPlan([0, 1], [0], "store")


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_registering_pageable_or_host_gpu_tiers_is_a_spec_mismatch(name):
    """A CPU tier that is not page-locked, or a GPU tier in host memory, is refused at register."""
    backend = BACKENDS[name]()
    gpu = allocate_kv(SPEC, "per-layer", 4, "cuda")
    with pytest.raises(SpecMismatchError, match="page-locked"):
        backend.register(regions_for(SPEC, "per-layer", gpu, allocate_kv(SPEC, "per-layer", 3)))
    with pytest.raises(SpecMismatchError, match="CUDA device"):
        backend.register(regions_for(SPEC, "per-layer", allocate_kv(SPEC, "per-layer", 4),
                                     _pinned_cache(SPEC, "per-layer", 3)))


def test_copies_from_another_thread_work():
    """Submitting from a thread that never touched CUDA works (the driver context is made current)."""
    import threading

    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128)
    gpu, cpu = _setup(spec, "per-layer", 16, 16, buffer=False, seed=6)
    errors = []
    for name in ("cuda-dma", "cupy-batch"):
        backend = BACKENDS[name]()
        backend.register(regions_for(spec, "per-layer", gpu, cpu))

        def run(backend=backend):
            try:
                backend.wait(backend.submit(TransferPlan([1, 3], [2, 4], "store")))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    assert errors == []
    assert torch.equal(cpu[0][0, 2].view(torch.uint8), gpu[0][0, 1].cpu().view(torch.uint8))


@pytest.mark.parametrize("name", ["torch", "cuda-dma", "cupy-batch"])
def test_a_copy_is_timed_by_its_own_work_not_by_what_it_waited_for(name):
    """A store ordered after a long kernel on another stream answers its copy's own seconds, not the wait's."""
    if not COPY.load(name).is_available():
        pytest.skip(COPY.why_unavailable(name))
    backend = COPY.create(name)
    gpu, cpu = _setup(SPEC, "per-layer", 16, 16, buffer=False, seed=7)
    regions = regions_for(SPEC, "per-layer", gpu, cpu)
    backend.register(regions)
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):
        torch.cuda._sleep(200_000_000)  # about 0.1 s at the clock rates of data-centre GPUs
        after = torch.cuda.Event()
        after.record(busy)
    n = sum(r.group == 0 for r in regions)
    handle, _ = backend.submit_stages(TransferPlan(np.arange(16), np.arange(16), "store"),
                                      [range(1), range(1, n)], after=[after, after])
    backend.wait(handle)
    assert backend.poll() == [handle]
    seconds = backend.copy_seconds(handle)
    assert seconds is not None and 0 < seconds < 0.02, seconds
    assert backend.poll() == [] and backend.copy_seconds(handle) is None
