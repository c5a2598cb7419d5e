"""A refused worker call raises a typed kvkit error quoting the value and changes nothing; the next valid call works."""

import math

import numpy as np
import pytest
import torch

from kvkit import errors
from kvkit.backends.copy import TorchCopy
from kvkit.errors import (
    ConfigError,
    InsufficientMemoryError,
    KVKitError,
    PlanError,
    SpecMismatchError,
    UnknownBlockError,
)
from kvkit.interfaces import KVCacheSpec, TransferPlan
from kvkit.testing.kvdata import fill_random
from kvkit.worker import layouts, memory
from kvkit.worker.engine import TransferEngine
from kvkit.worker.layouts import allocate_kv, kv_device

SPEC = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
RAW = (TypeError, AttributeError, ValueError, MemoryError, IndexError, RecursionError, RuntimeError)


def _engine(**kwargs):
    return TransferEngine(SPEC, TorchCopy(), num_cpu_blocks=4, **kwargs)


def _registered():
    engine = _engine()
    fill_random(engine.allocate_kv(4, "per-layer"), seed=1)
    return engine


def _unchanged(engine):
    """Nothing registered and nothing in flight; then a valid registration and round trip work."""
    assert engine.layout is None and engine.mirror_nbytes == 0 and engine.num_in_flight == 0
    engine.check_invariants()
    fill_random(engine.allocate_kv(3, "per-layer"), seed=2)
    engine.submit(0, TransferPlan([1], [2], "store"))
    assert [r.ok for r in engine.drain()] == [True]
    assert engine.read_block("cpu", 2) == engine.read_block("gpu", 1)


# -- KV tensors -------------------------------------------------------------------------

def _good(num_blocks=3, layout="per-layer"):
    return allocate_kv(SPEC, layout, num_blocks)


def _overlapping():
    buffer = torch.empty(2 * 2 * 3 * 4 * 2 * 8 + 8, dtype=torch.bfloat16)
    n = 2 * 3 * 4 * 2 * 8
    return [buffer[:n].view(2, 3, 4, 2, 8), buffer[n // 2:n // 2 + n].view(2, 3, 4, 2, 8)]


BAD_KV = {
    "numpy arrays": (lambda: [t.float().numpy() for t in _good()], r"tensor 0 must be a torch.Tensor, got ndarray"),
    "one numpy array": (lambda: np.zeros((2, 3, 4, 2, 8)), r"must be a list of torch.Tensor, got ndarray of shape"),
    "one tensor, not a list": (lambda: _good()[0],
                               r"got Tensor of shape \(2, 3, 4, 2, 8\) and dtype torch.bfloat16; hint: wrap one"),
    "a None in the list": (lambda: [_good()[0], None], r"tensor 1 must be a torch.Tensor, got NoneType None"),
    "a str": (lambda: "per-layer", r"must be a list of torch.Tensor, got str"),
    "meta tensors": (lambda: [t.to("meta") for t in _good()], r"tensor 0 holds no plain memory.*device meta"),
    "a sparse tensor": (lambda: [_good()[0].float().to_sparse(), _good()[1]], r"tensor 0 holds no plain.*sparse"),
    "wrong dtype": (lambda: [t.half() for t in _good()], r"dtype torch.float16, spec says 'bfloat16'"),
    "wrong shape": (lambda: [t[:, :, :2] for t in _good()], r"tensor 0 has shape \(2, 3, 2, 2, 8\)"),
    "wrong count": (lambda: _good()[:1], r"needs 2 tensors for 2 layers, got 1"),
    "not contiguous": (lambda: [t.transpose(3, 4).contiguous().transpose(3, 4) for t in _good()], r"not contiguous"),
    "the same tensor twice": (lambda: [_good()[0]] * 2, r"tensors 0 and 1 overlap in memory"),
    "overlapping views": (_overlapping, r"tensors 0 and 1 overlap in memory"),
    "no dims": (lambda: [torch.zeros((), dtype=torch.bfloat16)] * 2, r"too few dims"),
}


@pytest.mark.parametrize(("make", "pattern"), BAD_KV.values(), ids=BAD_KV.keys())
def test_bad_kv_tensors_are_refused_before_the_mirror(make, pattern):
    """register_kv refuses every bad cache with SpecMismatchError quoting it; nothing is allocated or registered."""
    engine = _engine()
    with pytest.raises(SpecMismatchError, match=pattern):
        engine.register_kv(make(), "per-layer")
    _unchanged(engine)


@pytest.mark.parametrize("layout", [None, 3, ["per-layer"], "nhd"])
def test_bad_layouts_are_refused(layout):
    """A layout that is not a known name is a ConfigError quoting it, from register_kv and allocate_kv."""
    engine = _engine()
    with pytest.raises(ConfigError, match="unknown KV layout"):
        engine.register_kv(_good(), layout)
    with pytest.raises(ConfigError, match="unknown KV layout"):
        engine.allocate_kv(3, layout)
    _unchanged(engine)


# -- transfer ids and plans -------------------------------------------------------------

PLAN = TransferPlan([0], [1], "store")
BAD_SUBMITS = {
    "negative id": (-1, PLAN, r"transfer_id=-1: must be an int >= 0"),
    "bool id": (True, PLAN, r"transfer_id=True: must be an int"),
    "float id": (1.0, PLAN, r"transfer_id=1.0: must be an int"),
    "str id": ("3", PLAN, r"transfer_id='3': must be an int"),
    "None id": (None, PLAN, r"transfer_id=None: must be an int"),
    "numpy float id": (np.float64(2), PLAN, r"transfer_id=.*2.*must be an int"),
    "id in flight": (9, PLAN, r"transfer id 9 is already in flight"),
    "plan None": (1, None, r"plan must be a TransferPlan, got NoneType None"),
    "plan a dict": (1, {"src": [0], "dst": [1]}, r"plan must be a TransferPlan, got dict"),
    "plan a str": (1, "store", r"plan must be a TransferPlan, got str"),
    "unregistered group": (1, TransferPlan([0], [1], "store", group=3), r"plan group 3 has no registered region"),
    "id out of range": (1, TransferPlan([9], [1], "store"), r"GPU block ids out of range \[0, 4\).*\[9\]"),
}


@pytest.mark.parametrize(("tid", "plan", "pattern"), BAD_SUBMITS.values(), ids=BAD_SUBMITS.keys())
def test_bad_submits_are_refused_and_change_nothing(tid, plan, pattern):
    """A bad transfer id or plan raises PlanError quoting it: nothing launched or in flight; the next submit works."""
    engine = _registered()
    engine.submit(9, TransferPlan([2], [3], "store"))
    before = [engine.read_block("cpu", b) for b in range(4)]
    with pytest.raises(PlanError, match=pattern):
        engine.submit(tid, plan)
    assert engine.num_in_flight == 1
    engine.check_invariants()
    assert [r.transfer_id for r in engine.poll()] == [9]
    assert [engine.read_block("cpu", b) for b in range(4)][:3] == before[:3]
    engine.submit(1, PLAN)
    assert [(r.transfer_id, r.ok) for r in engine.drain()] == [(1, True)]


def test_numpy_ids_become_ints():
    """A NumPy integer transfer id is accepted and reported as a plain int."""
    engine = _registered()
    engine.submit(np.int64(5), PLAN)
    [result] = engine.drain()
    assert result.transfer_id == 5 and type(result.transfer_id) is int


def test_a_launch_failure_keeps_its_id_until_reported(monkeypatch):
    """The id of a transfer that failed to launch is in flight until poll reports it, so it cannot be reused before."""
    engine = _registered()
    monkeypatch.setattr(TorchCopy, "submit", lambda self, plan, after=None: 1 / 0)
    with pytest.warns(RuntimeWarning, match="failed to launch"):
        engine.submit(4, PLAN)
    with pytest.raises(PlanError, match="transfer id 4 is already in flight"):
        engine.submit(4, PLAN)
    engine.check_invariants()
    assert [(r.transfer_id, r.ok) for r in engine.poll()] == [(4, False)]


@pytest.mark.parametrize("handle", [None, [0], "h", 0])
def test_a_backend_handle_that_breaks_the_contract_stays_in_doubt(monkeypatch, handle):
    """A handle that is no new int can never be confirmed: the transfer stays in flight, in doubt; nothing raises."""
    engine = _registered()
    monkeypatch.setattr(TorchCopy, "poll", lambda self: [])  # handle 0 not yet reported
    engine.submit(1, PLAN)  # handle 0 in flight
    real = TorchCopy.submit
    monkeypatch.setattr(TorchCopy, "submit", lambda self, plan, after=None: (real(self, plan), handle)[1])
    with pytest.warns(RuntimeWarning, match=r"not a new int: it stays in flight, in doubt"):
        engine.submit(2, TransferPlan([2], [3], "store"))
    assert (engine.num_in_flight, engine.num_in_doubt) == (2, 1)
    engine.check_invariants()
    monkeypatch.undo()
    with pytest.raises(errors.TransferTimeoutError) as err:
        engine.drain(timeout=0.05)
    assert err.value.pending == (2,)


# -- sizes and devices ------------------------------------------------------------------

@pytest.fixture
def small_host(monkeypatch):
    """Host memory reads as 64 KiB available: small caches are refused deterministically."""
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 64 << 10)


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if torch.empty allocates more than 64 KiB."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **{**kwargs, "device": "meta"})  # the size, without the memory
        assert t.numel() * t.element_size() <= 64 << 10, f"allocated {t.numel() * t.element_size()} bytes"
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)


def test_a_mirror_too_large_for_the_host_is_refused_before_allocating(small_host, no_allocation):
    """num_cpu_blocks beyond host memory: InsufficientMemoryError naming the size; no tensor allocated."""
    engine = TransferEngine(SPEC, TorchCopy(), num_cpu_blocks=1000)
    for call in (lambda: engine.allocate_kv(2, "per-layer"), lambda: engine.register_kv(_good(2), "per-layer")):
        with pytest.raises(InsufficientMemoryError, match=r"CPU mirror of num_cpu_blocks=1000 \(per-layer\): "
                                                          r"512000 bytes.*only 65536 bytes"):
            call()
        assert engine.layout is None and engine.mirror_nbytes == 0
        engine.check_invariants()


def test_a_gpu_tier_too_large_is_refused_before_allocating(small_host, no_allocation):
    """num_gpu_blocks beyond memory: refused naming the size, by the engine and the layout helper alike."""
    engine = _engine()
    with pytest.raises(InsufficientMemoryError, match=r"GPU tier of num_gpu_blocks=100000 \(per-layer\): 51200000 "):
        engine.allocate_kv(100_000, "per-layer")
    with pytest.raises(InsufficientMemoryError, match=r"KV cache of 100000 blocks \(per-layer\)"):
        allocate_kv(SPEC, "per-layer", 100_000)
    assert engine.layout is None and engine.mirror_nbytes == 0


def test_absurd_sizes_are_refused_on_any_machine():
    """10**12 blocks of cache or mirror never reach the allocator; the same engine then serves a valid call."""
    with pytest.raises(InsufficientMemoryError, match="num_gpu_blocks=1000000000000"):
        _engine().allocate_kv(10**12, "per-layer")
    with pytest.raises(InsufficientMemoryError, match="num_cpu_blocks=1000000000000"):
        TransferEngine(SPEC, TorchCopy(), num_cpu_blocks=10**12).allocate_kv(2, "per-layer")
    engine = _engine()
    with pytest.raises(InsufficientMemoryError):
        engine.allocate_kv(10**12, "blocks-first")
    _unchanged(engine)


def test_a_refusing_allocator_is_an_insufficient_memory_error(monkeypatch):
    """If torch refuses an allocation the check let through, the error is still typed and names the size."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("can't allocate memory")))
    with pytest.raises(InsufficientMemoryError, match=r"KV cache of 3 blocks .*can't allocate memory"):
        allocate_kv(SPEC, "per-layer", 3)


@pytest.mark.parametrize(("blocks", "pattern"), [(0, "num_gpu_blocks=0"), (2.5, "num_gpu_blocks=2.5"),
                                                  (True, "num_gpu_blocks=True"), ("4", "num_gpu_blocks='4'")])
def test_bad_gpu_block_counts(blocks, pattern):
    """allocate_kv's block count must be an int >= 1, quoted when it is not."""
    engine = _engine()
    with pytest.raises(ConfigError, match=pattern):
        engine.allocate_kv(blocks, "per-layer")
    _unchanged(engine)


@pytest.mark.parametrize(("device", "pattern"), [
    ("meta", "lives on cpu or cuda, not 'meta'"), ("tpu", "not a torch device"), (3.5, "not a torch device"),
    ("cuda:64", "this machine has"), (None, "not a torch device")])
def test_bad_devices_are_refused(device, pattern):
    """A device a KV cache cannot live on is a ConfigError quoting it, before anything is allocated."""
    engine = _engine()
    with pytest.raises(ConfigError, match=pattern):
        engine.allocate_kv(3, "per-layer", device)
    with pytest.raises(ConfigError, match=pattern):
        layouts.allocate_kv(SPEC, "per-layer", 3, device)
    _unchanged(engine)
    assert kv_device("cpu") == torch.device("cpu")


# -- construction and inspection --------------------------------------------------------

BAD_ENGINES = {
    "spec a str": (dict(spec="llama"), r"spec='llama': must be a KVCacheSpec"),
    "copy a class": (dict(copy=TorchCopy), r"got the class TorchCopy; hint: pass an instance, e.g. TorchCopy\(\)"),
    "copy a str": (dict(copy="torch"), r"CopyBackend, got str"),
    "zero blocks": (dict(num_cpu_blocks=0), r"num_cpu_blocks=0: must be an int >= 1"),
    "bool blocks": (dict(num_cpu_blocks=True), r"num_cpu_blocks=True"),
    "str blocks": (dict(num_cpu_blocks="4"), r"num_cpu_blocks='4'"),
    "negative rank": (dict(worker=-1), r"worker=-1: must be an int >= 0"),
    "float rank": (dict(worker=1.0), r"worker=1.0"),
    "zero timeout": (dict(wait_timeout_s=0), r"wait_timeout_s=0: must be a number in \(0"),
    "nan timeout": (dict(wait_timeout_s=math.nan), r"wait_timeout_s=nan"),
    "str timeout": (dict(wait_timeout_s="5"), r"wait_timeout_s='5'"),
    "None timeout": (dict(wait_timeout_s=None), r"wait_timeout_s=None"),
}


@pytest.mark.parametrize(("kwargs", "pattern"), BAD_ENGINES.values(), ids=BAD_ENGINES.keys())
def test_bad_engine_arguments(kwargs, pattern):
    """Every constructor argument is checked: a ConfigError quoting the value."""
    args = {"spec": SPEC, "copy": TorchCopy(), "num_cpu_blocks": 4} | kwargs
    with pytest.raises(ConfigError, match=pattern):
        TransferEngine(args.pop("spec"), args.pop("copy"), **args)


def test_numpy_counts_become_ints():
    """NumPy integers for the block count and rank are stored as ints."""
    engine = TransferEngine(SPEC, TorchCopy(), num_cpu_blocks=np.int32(3), worker=np.int64(2))
    assert (type(engine.num_cpu_blocks), type(engine.worker)) == (int, int)


@pytest.mark.parametrize(("block", "group", "error", "pattern"), [
    ("a", None, UnknownBlockError, r"gpu block 'a' out of range"),
    (1.0, None, UnknownBlockError, r"gpu block 1.0 out of range"),
    (True, None, UnknownBlockError, r"gpu block True out of range"),
    (-1, None, UnknownBlockError, r"gpu block -1 out of range \[0, 4\)"),
    (10**30, None, UnknownBlockError, r"out of range"),
    (None, None, UnknownBlockError, r"gpu block None"),
    (0, 7, ConfigError, r"group=7: not a registered KV group; groups: \[0\]"),
    (0, "0", ConfigError, r"group='0'"),
    (0, 0.0, ConfigError, r"group=0.0"),
])
def test_bad_block_reads(block, group, error, pattern):
    """read_block refuses non-int or out-of-range blocks and unknown groups with typed errors quoting them."""
    engine = _registered()
    with pytest.raises(error, match=pattern):
        engine.read_block("gpu", block, group)
    assert len(engine.read_block("gpu", np.int64(3), 0)) == SPEC.bytes_per_block


def test_no_raw_error_escapes_any_refusal():
    """Every refusal above is a KVKitError that also subclasses its matching built-in."""
    assert all(issubclass(InsufficientMemoryError, base) for base in (KVKitError, MemoryError, ConfigError))
    assert "InsufficientMemoryError" in errors.__all__
    engine = _registered()
    for call in (lambda: engine.submit(object(), PLAN), lambda: engine.register_kv(object(), "per-layer"),
                 lambda: engine.read_block(object(), object()), lambda: engine.drain(object())):
        with pytest.raises(KVKitError) as err:
            call()
        assert isinstance(err.value, RAW)


@pytest.mark.gpu
def test_a_cuda_cache_beyond_device_memory_is_refused_before_allocating():
    """A GPU tier larger than the device is an InsufficientMemoryError naming the device, from the engine and build."""
    import kvkit

    _, total = torch.cuda.mem_get_info()
    blocks = total // SPEC.bytes_per_block + 1
    engine = _engine()
    with pytest.raises(InsufficientMemoryError, match=rf"of memory on cuda.*num_gpu_blocks={blocks}"):
        engine.allocate_kv(blocks, "per-layer", "cuda")
    _unchanged(engine)
    with pytest.raises(InsufficientMemoryError, match="of memory on cuda"):
        kvkit.build(kv=SPEC, gpu_blocks=blocks, cpu_blocks=4, layout="per-layer", device="cuda")


BAD_OPTIONS = {
    "layered a str": ({"layered": "False"}, r"layered='False': must be a bool"),
    "layered an int": ({"layered": 1}, r"layered=1: must be a bool"),
    "layered None": ({"layered": None}, r"layered=None: must be a bool"),
    "written a str": ({"layered": True, "written": "abc"}, r"written='abc': must be a mapping"),
    "written a list": ({"layered": True, "written": [None]}, r"written=\[None\]: must be a mapping"),
    "written a str key": ({"layered": True, "written": {"0": None}}, r"key '0' is not a layer"),
    "written beyond the layers": ({"layered": True, "written": {2: None}}, r"key 2 is not a layer of the spec"),
}


@pytest.mark.parametrize(("options", "pattern"), BAD_OPTIONS.values(), ids=BAD_OPTIONS.keys())
def test_bad_submit_options_are_refused_and_launch_nothing(options, pattern):
    """``layered`` must be a bool and ``written`` a mapping of the spec's layers: else PlanError, nothing in flight."""
    engine = _registered()
    with pytest.raises(PlanError, match=pattern):
        engine.submit(1, PLAN, **options)
    assert engine.num_in_flight == 0 and engine.poll() == []
    engine.submit(1, PLAN, layered=True, written={0: None})
    assert [(r.transfer_id, r.ok) for r in engine.drain()] == [(1, True)]


BAD_WAITS = {
    "wait an int": (lambda e: e.wait(5), r"transfers=5: must be a collection"),
    "wait a float": (lambda e: e.wait(1.5), r"transfers=1.5: must be a collection"),
    "wait a str": (lambda e: e.wait("abc"), r"transfers='abc': must be a collection"),
    "wait a float id": (lambda e: e.wait([1.0]), r"transfer ids must be ints, got 1.0"),
    "wait None": (lambda e: e.wait(None), r"transfers=None"),
    "wait_layer transfers an int": (lambda e: e.wait_layer(0, transfers=5), r"transfers=5: must be a collection"),
    "wait_layer transfers a str": (lambda e: e.wait_layer(0, transfers="1"), r"transfers='1'"),
}


@pytest.mark.parametrize(("call", "pattern"), BAD_WAITS.values(), ids=BAD_WAITS.keys())
def test_bad_waits_are_config_errors_and_change_nothing(call, pattern):
    """A wait for something that is not a collection of transfer ids is refused, not taken as a wait for nothing."""
    engine = _registered()
    engine.submit(3, PLAN)
    with pytest.raises(ConfigError, match=pattern):
        call(engine)
    assert [r.transfer_id for r in engine.drain()] == [3]
