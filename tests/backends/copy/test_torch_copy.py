"""Tests for the torch copy backend beyond the copy backend contract (``test_contract.py``)."""

import threading

import numpy as np
import pytest
import torch

from kvkit.backends.copy import TorchCopy
from kvkit.errors import ConfigError, PlanError, SpecMismatchError
from kvkit.interfaces import CopyBackend, Direction, Region, TransferPlan
from kvkit.testing.kvdata import TWO_GROUPS, fill_random
from kvkit.worker.layouts import allocate_kv, regions_for


def _setup(spec, layout, num_gpu, num_cpu, device="cpu", seed=0):
    gpu, cpu = allocate_kv(spec, layout, num_gpu, device), allocate_kv(spec, layout, num_cpu)
    fill_random(gpu + cpu, seed)
    backend = TorchCopy()
    backend.register(regions_for(spec, layout, gpu, cpu))
    return backend


SPEC = TWO_GROUPS


def test_group_limits_use_the_smallest_region():
    """Ids are checked against the smallest region of the plan's group."""
    t = torch.zeros(4, 2)
    backend = TorchCopy()
    backend.register([Region("a", t, torch.zeros(3, 2)), Region("b", torch.zeros(2, 2), torch.zeros(3, 2))])
    with pytest.raises(PlanError, match=r"GPU block ids out of range \[0, 2\)"):
        backend.submit(TransferPlan([2], [0], "store"))


def test_poll_reports_each_handle_once_in_order():
    """Handles come back from poll in submission order, each exactly once."""
    backend = _setup(SPEC, "per-layer", 4, 4)
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
    backend = _setup(SPEC, "per-layer", 2, 2)
    with pytest.raises(PlanError, match="unknown copy handle 0"):
        backend.wait(0)


def test_register_rejects_duplicate_names():
    """Two regions of one name are refused."""
    t = torch.zeros(2, 3)
    with pytest.raises(SpecMismatchError, match=r"unique, got \['x', 'x'\]"):
        TorchCopy().register([Region("x", t, t.clone()), Region("x", t, t.clone())])


def test_register_replaces_regions():
    """A second register replaces the first: old groups are gone."""
    backend = _setup(SPEC, "per-layer", 2, 2)
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
    backend = _setup(SPEC, "per-layer", 4, 4, device="cuda")
    stream = backend.stream
    assert stream is not None and stream != torch.cuda.default_stream()
    assert stream.priority == torch.cuda.Stream.priority_range()[0]
    handle = backend.submit(TransferPlan([0, 3], [1, 2], "store"))
    backend.wait(handle)
    assert backend.poll() == [handle]


def test_host_thread_submit_returns_before_its_copy_lands_and_stages_land_on_return(monkeypatch):
    """``host_thread``: a held copy is not polled and its bytes are not there until it ran; stages land on return."""
    gpu, cpu = torch.zeros(4, 8), torch.arange(32.0).reshape(4, 8)
    backend = TorchCopy(host_thread=True)
    backend.register([Region("x", gpu, cpu)])
    gate, copy = threading.Event(), backend._copy_host
    monkeypatch.setattr(backend, "_copy_host", lambda plan, stages: (gate.wait(10), copy(plan, stages)))
    handle = backend.submit(TransferPlan([1], [2], "load"))
    assert backend.poll() == [] and not gpu[2].any()
    backend.check_invariants()
    gate.set()
    backend.wait(handle)
    assert torch.equal(gpu[2], cpu[1]) and backend.poll() == [handle]
    later, events = backend.submit_stages(TransferPlan([3], [0], "load"), [range(1)])
    assert events == [()] and torch.equal(gpu[0], cpu[3]) and backend.poll() == [later]
    with pytest.raises(ConfigError, match="host_thread"):
        TorchCopy(host_thread="yes")


def test_host_thread_copy_no_thread_can_start_for_raises_and_never_runs_later(monkeypatch):
    """``host_thread`` in a process at its thread limit (a container's pids limit): the submit raises, and the
    copy the pool had queued never runs once a later submit starts a thread, so blocks its caller was told
    were not copied (and may give to other data) are never written."""
    gpu, cpu = torch.zeros(4, 8), torch.arange(32.0).reshape(4, 8)
    backend = TorchCopy(host_thread=True)
    backend.register([Region("x", gpu, cpu)])

    def start(thread):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        backend.submit(TransferPlan([1], [2], "load"))
    monkeypatch.undo()
    backend.wait(backend.submit(TransferPlan([3], [0], "load")))
    assert torch.equal(gpu[0], cpu[3]) and not gpu[2].any(), "a copy whose submit raised ran later"
    backend.check_invariants()


@pytest.mark.parametrize("host_thread", [False, True])
def test_host_copies_are_timed_by_their_own_seconds(host_thread):
    """A host copy's own time is answered after the poll that reports it, and only until the next poll."""
    import time

    copy = TorchCopy(host_thread=host_thread)
    gpu, cpu = torch.arange(64 * 1024, dtype=torch.float32).view(64, 1024), torch.zeros(64, 1024)
    copy.register([Region("r", gpu, cpu)])
    handle = copy.submit(TransferPlan(np.arange(64), np.arange(64), Direction.STORE))
    copy.wait(handle)
    time.sleep(0.05)  # poll latency a submit-to-poll measure would count
    assert copy.poll() == [handle]
    seconds = copy.copy_seconds(handle)
    assert seconds is not None and 0 <= seconds < 0.05
    assert torch.equal(cpu, gpu)
    copy.poll()
    assert copy.copy_seconds(handle) is None
