"""Tests for the TransferEngine: mirror size, round trips, results and failures."""

import time

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkit.backends.copy import TorchCopy
from kvkit.errors import ConfigError, PlanError, SpecMismatchError, UnknownBlockError
from kvkit.interfaces import Direction, KVCacheSpec, Tier, TransferPlan, TransferResult
from kvkit.testing.kvdata import TWO_GROUPS, fill_random, kv_specs, plans, spec_layouts, tensor_bytes
from kvkit.worker.engine import TransferEngine
from kvkit.worker.layouts import LAYOUTS, allocate_kv, kv_nbytes, kv_shape, layouts_for, validate_kv

SPEC = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
LATENT = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype="bfloat16", latent=True)
KV_LAYOUTS = layouts_for(SPEC)  # every layout but MLA's latent one


def _engine(layout="per-layer", num_gpu=6, num_cpu=5, device="cpu", spec=SPEC, worker=0, cpu_layout=None):
    engine = TransferEngine(spec, TorchCopy(), num_cpu_blocks=num_cpu, worker=worker)
    gpu = engine.allocate_kv(num_gpu, layout, device, cpu_layout=cpu_layout)
    fill_random(gpu, seed=1)
    return engine


def _round_trip(engine, rng):
    """Store random GPU blocks of every group, overwrite the GPU, load them back elsewhere."""
    num_gpu, num_cpu = engine.regions[0].gpu.shape[0], engine.num_cpu_blocks
    groups = range(len(engine.spec.groups))
    n = int(rng.integers(1, min(num_gpu, num_cpu) + 1))
    src, mid, dst = ([rng.permutation(limit)[:n] for _ in groups] for limit in (num_gpu, num_cpu, num_gpu))
    original = [[engine.read_block("gpu", int(b), group=g) for b in src[g]] for g in groups]
    group_bytes = [sum(r.piece_bytes for r in engine.regions if r.group == g) for g in groups]
    for g in groups:
        engine.submit(10 + g, TransferPlan(src[g], mid[g], Direction.STORE, group=g))
    stored = sorted(engine.drain(), key=lambda r: r.transfer_id)
    assert stored == [TransferResult(10 + g, engine.worker, True, stored[g].seconds, n * group_bytes[g])
                      for g in groups]
    assert sum(group_bytes) == engine.spec.bytes_per_block
    assert [[engine.read_block("cpu", int(b), group=g) for b in mid[g]] for g in groups] == original
    fill_random(engine.gpu_kv, seed=2)  # the GPU copies are gone
    for g in groups:
        engine.submit(20 + g, TransferPlan(mid[g], dst[g], Direction.LOAD, group=g))
    loaded = sorted(engine.drain(), key=lambda r: r.transfer_id)
    assert [(r.transfer_id, r.ok, r.num_bytes) for r in loaded] == [(20 + g, True, n * group_bytes[g]) for g in groups]
    assert [[engine.read_block("gpu", int(b), group=g) for b in dst[g]] for g in groups] == original
    engine.check_invariants()


@given(spec_layouts(), st.integers(1, 5), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_store_then_load_round_trips(spec_layout, num_gpu, num_cpu, seed):
    """Bytes stored to the CPU mirror and loaded back equal the original bytes, every layout."""
    spec, layout = spec_layout
    _round_trip(_engine(layout, num_gpu, num_cpu, spec=spec), np.random.default_rng(seed))


@st.composite
def layout_pairs(draw):
    """A spec with a GPU and a CPU layout that pair (vllm-cpu only with itself, cross-layer for one group)."""
    spec = draw(kv_specs())
    if draw(st.booleans()):  # kv_specs splits layers into groups; cross-layer needs one
        spec = attrs.evolve(spec, groups=())
    valid = [lay for lay in layouts_for(spec) if lay != "cross-layer" or len(spec.groups) == 1]
    pairs = [(g, c) for g in valid for c in valid if g == c or "vllm-cpu" not in (g, c)]
    return spec, *draw(st.sampled_from(pairs))


def _half(layout, tensors, layer, half, block):
    """Bytes of one block's K (``half`` 0) or V (1) of ``layer``, ``[block_size, H, D]``, by the layout's definition."""
    if layout == "per-layer":
        t = tensors[layer][half, block]
    elif layout == "blocks-first":
        t = tensors[layer][block, half]
    elif layout == "cross-layer":
        t = tensors[0][block, layer, half]
    else:  # vllm-cpu: [H, block_size, 2 * D], each token row K then V
        d = tensors[layer].shape[-1] // 2
        t = tensors[layer][block, :, :, half * d:(half + 1) * d].transpose(0, 1)
    return tensor_bytes(t)


def _halves(spec, layout, tensors):
    """``_half`` of every (layer, half, block) of one tier."""
    num_blocks = validate_kv(spec, layout, tensors)
    return {(i, h, b): _half(layout, tensors, i, h, b)
            for i in range(spec.num_layers) for h in (0, 1) for b in range(num_blocks)}


@given(layout_pairs(), st.integers(1, 5), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_mixed_layouts_round_trip(spec_pair, num_gpu, num_cpu, seed):
    """Stores to a CPU mirror in another layout and loads back round-trip every byte, every allowed pair."""
    spec, layout, cpu_layout = spec_pair
    engine = TransferEngine(spec, TorchCopy(), num_cpu_blocks=num_cpu)
    fill_random(engine.allocate_kv(num_gpu, layout, cpu_layout=cpu_layout), seed=1)
    assert (engine.layout, engine.cpu_layout) == (layout, cpu_layout)
    assert [t.shape for t in engine.cpu_kv] == [torch.Size(s) for s in kv_shape(spec, cpu_layout, num_cpu)]
    _round_trip(engine, np.random.default_rng(seed))


@given(layout_pairs(), st.data())
def test_copies_move_each_layers_k_and_v_between_layouts(spec_pair, data):
    """After any plan, each destination block holds its source's K and V of every layer of the plan's group;
    nothing else changes."""
    spec, layout, cpu_layout = spec_pair
    num_gpu, num_cpu = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 4))
    engine = TransferEngine(spec, TorchCopy(), num_cpu_blocks=num_cpu)
    fill_random(engine.allocate_kv(num_gpu, layout, cpu_layout=cpu_layout), seed=1)
    fill_random(engine.cpu_kv, seed=2)
    plan = data.draw(plans(len(spec.groups), num_gpu, num_cpu).filter(len))
    tiers = {"gpu": (layout, engine.gpu_kv), "cpu": (cpu_layout, engine.cpu_kv)}
    src, dst = ("gpu", "cpu") if plan.direction is Direction.STORE else ("cpu", "gpu")
    before, want = _halves(spec, *tiers[src]), _halves(spec, *tiers[dst])
    for layer in spec.groups[plan.group].layers:
        for s, d in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
            for h in (0, 1):
                want[layer, h, d] = before[layer, h, s]
    engine.submit(1, plan)
    assert [r.ok for r in engine.drain()] == [True]
    got = _halves(spec, *tiers[dst])
    assert all(torch.equal(got[key], want[key]) for key in want)


@given(kv_specs().filter(lambda spec: len(spec.groups) == 1), st.sampled_from(["per-layer", "blocks-first"]),
       st.integers(0, 2**32 - 1))
def test_cross_layer_cpu_block_holds_every_layer_in_order(spec, layout, seed):
    """A stored block of a cross-layer CPU tier is layer 0's K, V, layer 1's K, V... of its GPU block, back to back."""
    rng = np.random.default_rng(seed)
    engine = TransferEngine(spec, TorchCopy(), num_cpu_blocks=5)
    gpu = engine.allocate_kv(4, layout, cpu_layout="cross-layer")
    fill_random(gpu, seed=seed)
    n = int(rng.integers(1, 5))
    src, dst = rng.permutation(4)[:n], rng.permutation(5)[:n]
    engine.submit(1, TransferPlan(src, dst, Direction.STORE))
    assert [r.ok for r in engine.drain()] == [True]
    flat, lb = tensor_bytes(engine.cpu_kv[0]), spec.bytes_per_layer_block
    assert flat.numel() == 5 * spec.bytes_per_block == engine.mirror_nbytes
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        for i in range(spec.num_layers):
            for h in (0, 1):
                k_or_v = gpu[i][h, s] if layout == "per-layer" else gpu[i][s, h]
                at = d * spec.bytes_per_block + (2 * i + h) * lb
                assert torch.equal(flat[at:at + lb], tensor_bytes(k_or_v))


@pytest.mark.parametrize(("layout", "cpu_layout", "pattern"), [
    ("per-layer", "vllm-cpu", "GPU layout 'per-layer' with CPU layout 'vllm-cpu'"),
    ("vllm-cpu", "blocks-first", "GPU layout 'vllm-cpu' with CPU layout 'blocks-first'"),
    ("per-layer", "nhd", "unknown KV layout 'nhd'"),
])
def test_bad_cpu_layout_is_refused_before_the_mirror(layout, cpu_layout, pattern):
    """Layouts that do not pair are refused by register_kv and allocate_kv before any mirror exists."""
    engine = TransferEngine(SPEC, TorchCopy(), num_cpu_blocks=2)
    with pytest.raises(ConfigError, match=pattern):
        engine.register_kv(allocate_kv(SPEC, layout, 3), layout, cpu_layout=cpu_layout)
    with pytest.raises(ConfigError, match=pattern):
        engine.allocate_kv(3, layout, cpu_layout=cpu_layout)
    assert engine.layout is None and engine.cpu_layout is None and engine.mirror_nbytes == 0
    engine.check_invariants()


def test_cross_layer_cpu_with_two_groups_is_refused():
    """A cross-layer CPU mirror spans every layer, so a two-group cache cannot use one."""
    engine = TransferEngine(TWO_GROUPS, TorchCopy(), num_cpu_blocks=2)
    with pytest.raises(ConfigError, match="single KV group"):
        engine.allocate_kv(3, "per-layer", cpu_layout="cross-layer")
    assert engine.mirror_nbytes == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mirror_is_exact_size(layout):
    """The mirror is one host buffer of exactly num_cpu_blocks blocks, unpinned on CPU."""
    spec = LATENT if layout == "latent" else SPEC
    engine = _engine(layout, num_gpu=3, num_cpu=7, spec=spec)
    assert engine.mirror_nbytes == 7 * spec.bytes_per_block == kv_nbytes(spec, layout, 7)
    assert sum(t.numel() * t.element_size() for t in engine.cpu_kv) == engine.mirror_nbytes
    assert all(r.cpu.shape[0] == 7 and r.gpu.shape[0] == 3 for r in engine.regions)
    assert not engine.mirror_pinned
    assert engine.layout == engine.cpu_layout == layout
    engine.check_invariants()


def test_results_carry_worker_and_bytes():
    """Each result names its transfer id, this worker and the bytes of its group's regions."""
    engine = _engine(worker=3)
    engine.submit(7, TransferPlan([0, 1], [0, 1], "store"))
    engine.submit(8, TransferPlan([], [], "load"))
    assert engine.num_in_flight == 2
    results = engine.poll()
    assert [(r.transfer_id, r.worker, r.ok, r.num_bytes) for r in results] == [
        (7, 3, True, 2 * SPEC.bytes_per_block), (8, 3, True, 0)]
    assert all(r.seconds >= 0 for r in results)
    assert engine.poll() == [] and engine.num_in_flight == 0


def test_submit_before_register_is_refused():
    """A transfer before any KV cache is registered raises ConfigError."""
    engine = TransferEngine(SPEC, TorchCopy(), num_cpu_blocks=2)
    with pytest.raises(ConfigError, match="no KV cache registered"):
        engine.submit(0, TransferPlan([0], [0], "store"))


def test_register_twice_is_refused_until_close():
    """A second register_kv needs close() first, after which it works again."""
    engine = _engine()
    with pytest.raises(ConfigError, match="already registered"):
        engine.allocate_kv(2, "per-layer")
    assert engine.close() == []
    engine.check_invariants()
    assert engine.mirror_nbytes == 0 and engine.layout is None
    engine.allocate_kv(2, "cross-layer")
    assert engine.mirror_nbytes == 5 * SPEC.bytes_per_block


def test_register_validates_tensors():
    """Tensors that disagree with the spec are refused before anything is allocated."""
    engine = TransferEngine(SPEC, TorchCopy(), num_cpu_blocks=2)
    bad = allocate_kv(KVCacheSpec(2, 4, 2, 8, dtype="float16"), "per-layer", 3)
    with pytest.raises(SpecMismatchError, match="float16"):
        engine.register_kv(bad, "per-layer")
    assert engine.layout is None and engine.mirror_nbytes == 0


@pytest.mark.parametrize("kwargs", [dict(num_cpu_blocks=0), dict(num_cpu_blocks=2.5)])
def test_bad_cpu_block_count(kwargs):
    """num_cpu_blocks must be a positive int, quoted when it is not."""
    with pytest.raises(ConfigError, match=str(kwargs["num_cpu_blocks"])):
        TransferEngine(SPEC, TorchCopy(), **kwargs)


def test_copy_must_be_a_backend():
    """A copy object that is not a CopyBackend is refused at construction."""
    with pytest.raises(ConfigError, match="CopyBackend, got str"):
        TransferEngine(SPEC, "torch", num_cpu_blocks=2)


def test_the_backends_self_check_is_decided_at_construction():
    """A SelfChecking backend is checked by the engine's check_invariants; one without it is skipped; copy is fixed."""
    checks = []
    counted = type("Counted", (TorchCopy,), {"check_invariants": lambda self: checks.append(self)})()
    engine = TransferEngine(SPEC, counted, num_cpu_blocks=2)
    engine.allocate_kv(2, "blocks-first")
    engine.check_invariants()
    assert checks == [counted]
    unchecked = TransferEngine(SPEC, type("Unchecked", (TorchCopy,), {"check_invariants": None})(),
                               num_cpu_blocks=2)
    unchecked.allocate_kv(2, "blocks-first")
    unchecked.check_invariants()
    with pytest.raises(attrs.exceptions.FrozenAttributeError):
        engine.copy = TorchCopy()


def test_blocks_are_read_by_tier_member_or_value():
    """read_block takes a Tier or its string value alike."""
    engine = _engine()
    assert engine.read_block(Tier.GPU, 1) == engine.read_block("gpu", 1)
    assert engine.read_block(Tier.CPU, 1) == engine.read_block("cpu", 1)


def test_plan_errors_propagate():
    """A plan the backend rejects raises PlanError at submit and leaves nothing in flight."""
    engine = _engine()
    with pytest.raises(PlanError, match=r"\[9\]"):
        engine.submit(1, TransferPlan([9], [0], "store"))
    assert engine.num_in_flight == 0 and engine.poll() == []


def test_duplicate_transfer_id_in_flight():
    """A transfer id still in flight cannot be submitted again."""
    engine = _engine()
    engine.submit(4, TransferPlan([0], [0], "store"))
    with pytest.raises(PlanError, match="transfer id 4 is already in flight"):
        engine.submit(4, TransferPlan([1], [1], "store"))
    assert [r.transfer_id for r in engine.poll()] == [4]
    engine.submit(4, TransferPlan([1], [1], "store"))  # reported, so free again


class _Failing(TorchCopy):
    """A backend whose copies fail at launch or at poll, or are not confirmed yet (``held``: still running)."""

    fail_submit: bool = False
    fail_poll: bool = False
    held: bool = False

    def submit(self, plan, *, after=None):
        if _Failing.fail_submit:
            raise RuntimeError("CUDA error: out of memory")
        return super().submit(plan, after=after)

    def poll(self):
        if _Failing.fail_poll:
            raise RuntimeError("CUDA error: an illegal memory access")
        return [] if _Failing.held else super().poll()


@pytest.fixture
def failing(monkeypatch):
    monkeypatch.setattr(_Failing, "fail_submit", False)
    monkeypatch.setattr(_Failing, "fail_poll", False)
    monkeypatch.setattr(_Failing, "held", False)
    engine = TransferEngine(SPEC, _Failing(), num_cpu_blocks=4)
    engine.allocate_kv(4, "blocks-first")
    return engine


def test_failed_launch_is_a_failed_result(failing, monkeypatch):
    """A copy that fails to launch comes back from poll as ok=False, with a warning."""
    monkeypatch.setattr(_Failing, "fail_submit", True)
    with pytest.warns(RuntimeWarning, match="transfer 5 failed to launch.*out of memory"):
        failing.submit(5, TransferPlan([0], [0], "store"))
    assert failing.poll() == [TransferResult(5, 0, ok=False)]
    assert failing.poll() == []


def test_failed_poll_keeps_transfers_in_doubt_until_the_backend_confirms_them(failing, monkeypatch):
    """A failing poll reports nothing: both transfers stay in flight, in doubt, then come back ok=False once each."""
    monkeypatch.setattr(_Failing, "held", True)  # as copies on a device stream: not done at submit
    failing.submit(1, TransferPlan([0], [0], "store"))
    failing.submit(2, TransferPlan([1], [1], "load"))
    monkeypatch.setattr(_Failing, "held", False)
    monkeypatch.setattr(_Failing, "fail_poll", True)
    with pytest.warns(RuntimeWarning, match=r"in doubt now: 2 transfers in flight \[1, 2\]"):
        assert failing.poll() == []
    assert (failing.num_in_flight, failing.num_in_doubt) == (2, 2)
    failing.check_invariants()
    monkeypatch.setattr(_Failing, "fail_poll", False)
    assert sorted((r.transfer_id, r.ok) for r in failing.poll()) == [(1, False), (2, False)]
    assert failing.poll() == [] and failing.num_in_flight == 0 == failing.num_in_doubt
    failing.check_invariants()


def test_a_host_copy_is_timed_by_submit_not_by_the_next_poll():
    """A copy the backend runs inside submit reports its own time, however late the poll that hands it out."""
    engine = _engine(num_gpu=6, num_cpu=5)
    started = time.perf_counter()
    engine.submit(1, TransferPlan([0, 1], [0, 1], "store"))
    submitted = time.perf_counter() - started
    time.sleep(0.2)
    (result,) = engine.poll()
    assert 0 < result.seconds <= submitted < 0.2
    assert result.num_bytes == 2 * SPEC.bytes_per_block


def test_block_access_errors():
    """read_block refuses unknown tiers and out-of-range blocks, quoting them."""
    engine = _engine(num_gpu=6, num_cpu=5)
    with pytest.raises(ConfigError, match="'disk'"):
        engine.read_block("disk", 0)
    with pytest.raises(UnknownBlockError, match=r"cpu block 5 out of range \[0, 5\)"):
        engine.read_block("cpu", 5)
    assert len(engine.read_block("gpu", 5)) == SPEC.bytes_per_block
    assert len(engine.read_block("gpu", 5, group=0)) == SPEC.bytes_per_block


@given(spec_layouts(), st.integers(1, 5), st.data())
def test_cpu_block_views_are_the_mirror_bytes_of_block_pieces(spec_layout, num_cpu, data):
    """Each CPU block's views are its pieces' bytes, region by region, and writing through them writes the mirror."""
    spec, layout = spec_layout
    engine = _engine(layout, 2, num_cpu, spec=spec)
    fill_random(engine.cpu_kv, seed=3)
    for block in range(num_cpu):
        views = engine.cpu_block_views(block)
        pieces = engine.block_pieces(Tier.CPU, block)
        assert [bytes(v) for v in views] == [tensor_bytes(p).numpy().tobytes() for p in pieces]
        assert b"".join(views) == engine.read_block(Tier.CPU, block)
    block = data.draw(st.integers(0, num_cpu - 1))
    for view in engine.cpu_block_views(block):
        view[:] = b"\x5a" * len(view)
    assert engine.read_block(Tier.CPU, block) == b"\x5a" * spec.bytes_per_block
    assert all(engine.read_block(Tier.CPU, b) != b"\x5a" * spec.bytes_per_block for b in range(num_cpu) if b != block)


def test_a_cpu_piece_that_is_not_contiguous_is_refused():
    """A region whose block pieces are not one run of bytes each (no layout makes one) is refused, quoting its
    shape and strides, rather than read through a copy."""
    from kvkit.worker.engine import _piece_slots

    mirror = torch.zeros(4 * 2 * 8, dtype=torch.uint8)
    blocks = mirror.view(4, 2, 8)
    assert _piece_slots(blocks, mirror) == (0, 16, 16)
    with pytest.raises(ConfigError, match=r"shape \(8, 2\) and strides \(1, 8\) is not contiguous"):
        _piece_slots(blocks.transpose(1, 2), mirror)


def test_cpu_block_views_refusals():
    """cpu_block_views refuses blocks out of range, quoting them, and an engine with no KV registered."""
    engine = _engine(num_gpu=6, num_cpu=5)
    for bad in (5, -1, "1", 1.0):
        with pytest.raises(UnknownBlockError, match=r"cpu block .* out of range \[0, 5\)"):
            engine.cpu_block_views(bad)
    engine.close()
    with pytest.raises(ConfigError, match="no KV cache registered"):
        engine.cpu_block_views(0)


# -- CUDA ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_round_trip(layout):
    """Stores and loads between a CUDA cache and the pinned mirror round-trip every layout (MLA's 576-wide latent)."""
    spec = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")
    if layout == "latent":
        spec = attrs.evolve(spec, num_kv_heads=1, head_dim=576, latent=True)
    engine = _engine(layout, num_gpu=32, num_cpu=24, device="cuda", spec=spec)
    for seed in range(4):
        _round_trip(engine, np.random.default_rng(seed))
    engine.close()


MIXED = [(g, c) for g in KV_LAYOUTS for c in KV_LAYOUTS if g != c and "vllm-cpu" not in (g, c)]


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "cpu_layout"), MIXED)
def test_cuda_round_trip_between_layouts(layout, cpu_layout):
    """Stores and loads between a CUDA cache and a pinned mirror in another layout round-trip."""
    spec = KVCacheSpec(num_layers=4, block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")
    engine = _engine(layout, num_gpu=32, num_cpu=24, device="cuda", spec=spec, cpu_layout=cpu_layout)
    assert engine.mirror_pinned
    for seed in range(4):
        _round_trip(engine, np.random.default_rng(seed))
    engine.close()


@pytest.mark.gpu
def test_cuda_store_is_ordered_after_compute():
    """A store submitted right after queued kernels that write its source copies the new bytes."""
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    engine = _engine("per-layer", num_gpu=64, num_cpu=64, device="cuda", spec=spec)
    for t in engine.gpu_kv:
        t.zero_()
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda")
    out = torch.empty_like(a)
    for _ in range(20):  # hundreds of ms of work ahead of the fill on the compute stream
        torch.mm(a, a, out=out)
    for t in engine.gpu_kv:
        t.fill_(3.0)
    engine.submit(1, TransferPlan(np.arange(64), np.arange(64), "store"))
    [result] = engine.drain()
    assert result.ok
    assert all(bool((t == 3.0).all()) for t in engine.cpu_kv)
    engine.close()


@pytest.mark.gpu
def test_cuda_load_is_ordered_after_compute():
    """A load submitted after queued kernels that still read its destination waits for them."""
    spec = KVCacheSpec(num_layers=1, block_size=16, num_kv_heads=8, head_dim=128, dtype="float32")
    engine = _engine("cross-layer", num_gpu=16, num_cpu=16, device="cuda", spec=spec)
    engine.cpu_kv[0].fill_(5.0)
    gpu = engine.gpu_kv[0]
    gpu.fill_(1.0)
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, device="cuda")
    out = torch.empty_like(a)
    for _ in range(20):
        torch.mm(a, a, out=out)
    seen = gpu.sum()  # reads the destination after the matmuls, before the load may write it
    engine.submit(2, TransferPlan(np.arange(16), np.arange(16), "load"))
    [result] = engine.drain()
    assert result.ok
    assert seen.item() == gpu.numel()
    assert bool((gpu == 5.0).all())
    engine.close()


@pytest.mark.gpu
def test_cuda_mirror_is_registered_and_exact():
    """On CUDA the mirror is page-locked in place, exactly sized, and unregistered by close."""
    spec = KVCacheSpec(num_layers=3, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    engine = _engine("per-layer", num_gpu=8, num_cpu=1000, device="cuda", spec=spec)
    assert engine.mirror_pinned
    view = engine.cpu_kv[0]
    assert view.is_pinned()
    assert view.untyped_storage().nbytes() == 1000 * spec.bytes_per_block == engine.mirror_nbytes
    engine.close()
    assert not view.is_pinned()
