"""A submit that raises leaves nothing of its plan running: what it had queued finished before it raised."""

import threading

import numpy as np
import pytest
import torch

from kvkit.backends.copy import TorchCopy
from kvkit.backends.copy.auto import AutoCopy
from kvkit.interfaces import Direction, KVCacheSpec, TransferPlan
from kvkit.registry import COPY
from kvkit.testing import ThreadedCopy
from kvkit.testing.kvdata import fill_random
from kvkit.worker.layouts import allocate_kv, kv_nbytes, kv_views, regions_for

SPEC = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")


class _Refuses(TorchCopy):
    """A backend whose every submit raises (after validating), like a failed driver call."""

    def submit(self, plan, *, after=None):
        raise RuntimeError("launch failed")


def test_auto_waits_for_the_parts_it_launched_before_a_later_part_failed():
    """When the engines' part of a split plan fails to launch, the kernel's part already queued has landed first."""
    gpu, cpu = allocate_kv(SPEC, "per-layer", 4, "cpu"), allocate_kv(SPEC, "per-layer", 4, "cpu")
    fill_random(gpu + cpu, seed=1)
    kernel = ThreadedCopy()
    auto = AutoCopy(dma=_Refuses(), kernel=kernel, kernel_share=0.5, dma_min_bytes=1 << 40)
    auto.register(regions_for(SPEC, "per-layer", gpu, cpu))
    gate = kernel.hold()
    threading.Timer(0.2, gate.set).start()  # the kernel's part lands late
    with pytest.raises(RuntimeError, match="launch failed"):
        auto.submit(TransferPlan([0, 1], [2, 3], "store"))
    assert kernel.landed(0), "submit raised while its first part could still write"
    assert auto.poll() == []
    auto.check_invariants()


# -- CUDA --------------------------------------------------------------------------------


def _cuda_tiers(num_blocks=256, cpu_layout="per-layer"):
    gpu = allocate_kv(SPEC, "per-layer", num_blocks, "cuda")
    host = torch.empty(kv_nbytes(SPEC, cpu_layout, num_blocks), dtype=torch.uint8, pin_memory=True)
    cpu = kv_views(SPEC, cpu_layout, num_blocks, host)
    fill_random(gpu + cpu, seed=2)
    return gpu, cpu


def _raise_after_launch(monkeypatch, cls):
    """Make ``cls._launch`` queue its copies for real, then raise (a launch that failed halfway)."""
    real = cls._launch

    def launch(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise RuntimeError("launch failed halfway")

    monkeypatch.setattr(cls, "_launch", launch)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["torch", "cuda-dma", "cupy-batch"])
def test_a_gpu_backend_that_fails_mid_launch_quiesces_its_stream(monkeypatch, name):
    """A launch that raised after queueing copies is synchronized before submit raises: the stream is idle."""
    if not COPY.load(name).is_available():
        pytest.skip(f"{name} is unavailable")
    backend = COPY.create(name)
    gpu, cpu = _cuda_tiers()
    backend.register(regions_for(SPEC, "per-layer", gpu, cpu))
    _raise_after_launch(monkeypatch, type(backend))
    plan = TransferPlan(np.arange(256), np.arange(256)[::-1].copy(), "store")
    with pytest.raises(RuntimeError, match="halfway"):
        backend.submit(plan)
    stream = backend.stream if name == "torch" else backend.stream(Direction.STORE)
    assert stream.query(), "the stream still runs a copy of a submit that raised"
    assert backend.poll() == []
    backend.check_invariants()


@pytest.mark.gpu
def test_staged_that_fails_on_a_later_chunk_quiesces_both_streams(monkeypatch):
    """A staged plan whose second chunk fails to launch leaves neither inner stream running."""
    if not COPY.load("staged").is_available():
        pytest.skip("staged is unavailable")
    from kvkit.backends.copy._gpu_copy import GPUCopy
    from kvkit.backends.copy.cuda_dma import CudaDMACopy

    backend = COPY.create("staged", chunk_blocks=32, slots=2)
    gpu, cpu = _cuda_tiers(cpu_layout="cross-layer")
    backend.register(regions_for(SPEC, "per-layer", gpu, cpu, cpu_layout="cross-layer"))
    calls = []

    def second_fails(self, plan, *, after=None):
        calls.append(plan)
        if len(calls) == 2:
            raise RuntimeError("launch failed")
        return GPUCopy.submit(self, plan, after=after)

    monkeypatch.setattr(CudaDMACopy, "submit", second_fails)  # the DMA half of each chunk
    with pytest.raises(RuntimeError, match="launch failed"):
        backend.submit(TransferPlan(np.arange(128), np.arange(128), "store"))
    assert len(calls) == 2
    assert backend._kernel.stream(Direction.STORE).query() and backend._dma.stream(Direction.STORE).query()
    assert backend.poll() == []
